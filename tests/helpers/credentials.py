"""Credential files as a user's working directory may hold them, for the tests of `tandem submit`."""

PRIVATE_KEY = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gt\n"
               "-----END OPENSSH PRIVATE KEY-----\n")
# the credentials the probe of issue 26 found on the head after `tandem submit` (and what they look like)
CREDENTIALS = {".ssh/id_ed25519": PRIVATE_KEY, ".ssh/known_hosts": "head ssh-ed25519 AAAAC3Nza\n",
               "id_ed25519": PRIVATE_KEY, "id_ecdsa": PRIVATE_KEY, "server.key": PRIVATE_KEY,
               ".aws/credentials": "[default]\naws_access_key_id = AKIAIOSFODNN7EXAMPLE\n",
               ".config/gcloud/application_default_credentials.json": '{"type": "authorized_user"}\n',
               ".azure/accessTokens.json": "[]\n", ".kube/config": "apiVersion: v1\n", "cert.p12": "x",
               ".pypirc": "[pypi]\npassword = pypi-AgEIcHlwaS5vcmc\n", ".npmrc": "//registry/:_authToken=x\n",
               ".envrc": "export TOKEN=x\n", ".netrc": "machine h login u password p\n",
               ".ray/auth_token": "0123abcd\n", "home/.config/gcloud/credentials.db": "x"}
# innocent names, credential content: found by the scanner
SECRET_CONTENT = {"settings.py": 'AWS_KEY = "AKIAIOSFODNN7EXAMPLE"\n', "notes/deploy.txt": PRIVATE_KEY,
                  "conf.ini": 'password = "hunter2hunter2"\n'}


def write_tree(root, files: dict) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
