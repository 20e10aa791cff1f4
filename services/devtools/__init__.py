"""Tools for developing and showing Tandem, outside the runtime: the demo, the README's job file reference, the tiny
model the tests, the demo and the benchmarks build."""
