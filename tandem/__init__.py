"""Tandem: distributed GRPO training."""
