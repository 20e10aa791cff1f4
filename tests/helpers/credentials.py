"""Credential files as a user's working directory may hold them, for the tests of `tandem submit`."""

PRIVATE_KEY = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gt\n"
               "-----END OPENSSH PRIVATE KEY-----\n")
# credentials a probe of `tandem submit` found on the head (and what they look like)
CREDENTIALS = {".ssh/id_ed25519": PRIVATE_KEY, ".ssh/known_hosts": "head ssh-ed25519 AAAAC3Nza\n",
               "id_ed25519": PRIVATE_KEY, "id_ecdsa": PRIVATE_KEY, "server.key": PRIVATE_KEY,
               ".aws/credentials": "[default]\naws_access_key_id = AKIAIOSFODNN7EXAMPLE\n",
               ".config/gcloud/application_default_credentials.json": '{"type": "authorized_user"}\n',
               ".azure/accessTokens.json": "[]\n", ".kube/config": "apiVersion: v1\n", "cert.p12": "x",
               ".pypirc": "[pypi]\npassword = pypi-AgEIcHlwaS5vcmc\n", ".npmrc": "//registry/:_authToken=x\n",
               ".envrc": "export TOKEN=x\n", ".netrc": "machine h login u password p\n",
               ".ray/auth_token": "0123abcd\n", "home/.config/gcloud/credentials.db": "x"}
HF_TOKEN = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ012345678"
# and those a later probe found: Hugging Face, Kaggle, Vault, PostgreSQL, rclone, docker, a Google client secret
CREDENTIALS.update({".cache/huggingface/token": HF_TOKEN + "\n", ".huggingface/token": HF_TOKEN + "\n",
                    ".kaggle/kaggle.json": '{"username": "u", "key": "0123456789abcdef"}\n', ".vault-token": "s.x\n",
                    ".pgpass": "db:5432:*:u:pw\n", ".config/rclone/rclone.conf": "[s3]\ntype = s3\n",
                    "credentials.json": '{"installed": {"client_secret": "x"}}\n',
                    ".dockercfg": '{"https://index.docker.io/v1/": {"auth": "dTpw"}}\n'})
# innocent names, credential content: found by the scanner (bytes: written as they are)
SECRET_CONTENT = {"settings.py": 'AWS_KEY = "AKIAIOSFODNN7EXAMPLE"\n', "notes/deploy.txt": PRIVATE_KEY,
                  "conf.ini": 'password = "hunter2hunter2"\n', "scripts/train.sh": f"export HF_TOKEN={HF_TOKEN}\n",
                  "launch.sh": "export WANDB_API_KEY=0123456789abcdef0123\n",
                  "registry.json": '{"auths": {"ghcr.io": {"auth": "dXNlcjpwYXNzd29yZA=="}}}\n',
                  "notes/utf16.txt": PRIVATE_KEY.encode("utf-16"), "notes/utf32be.txt": PRIVATE_KEY.encode("utf-32-be"),
                  "notes/trailing space.txt ": PRIVATE_KEY, "notes/back\\slash.txt": PRIVATE_KEY}


def write_tree(root, files: dict) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            (root / rel).write_bytes(text)
        else:
            (root / rel).write_text(text)
