"""An s3:// run directory on a node without credentials is said as such, not as the store's bare code: against a real
S3 API (moto's server, in a process of its own), from a process whose environment gives none."""

import os
import subprocess
import sys
import time

import pytest

from tandem.services.devtools.local_nodes import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def endpoint():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="t",
                          aws_secret_access_key="t", region_name="us-east-1")
    for _ in range(100):
        try:
            client.create_bucket(Bucket="tandem-runs")
            break
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    server.kill()


def reach(endpoint: str, home, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    clean.update(AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1", HOME=str(home), **env)
    code = "from tandem.core.storage import check_reachable; print(check_reachable('s3://tandem-runs/run', 'f'))"
    return subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_a_node_without_credentials_is_told_so(endpoint, tmp_path):
    said = reach(endpoint, tmp_path, AWS_EC2_METADATA_DISABLED="true")
    assert said.startswith("f = 's3://tandem-runs/run': this node has no credentials for it (none of "
                           "AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws/credentials"), said
    assert reach(endpoint, tmp_path, AWS_EC2_METADATA_DISABLED="true", AWS_ACCESS_KEY_ID="t",
                 AWS_SECRET_ACCESS_KEY="t") == "None"  # with them: reachable
