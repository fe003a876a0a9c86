"""No secret defaults: each install signs with its own key, never with one written in the source.

Without ``SECRET_KEY`` the first process generates a key into a file (mode 0600, created
atomically) that every later run and every process reads; the public key of earlier versions
refuses to start unless ``DEBUG`` is on.
"""

from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.messages import constants
from django.contrib.messages.storage.base import Message
from django.contrib.messages.storage.cookie import CookieStorage
from django.core import signing
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest

from llm_platform.secret_key import PUBLIC_KEYS, load_secret_key

REPO = Path(__file__).resolve().parents[2]
PUBLIC_KEY = "insecure-local-key-set-SECRET_KEY-in-production"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_install_gets_its_own_key_once(tmp_path):
    path = tmp_path / "var" / "secret_key"
    first = load_secret_key("", debug=False, path=path)
    assert len(first) >= 50 and first not in PUBLIC_KEYS
    assert path.read_text().strip() == first and mode(path) == 0o600
    assert load_secret_key(None, debug=False, path=path) == first
    assert os.listdir(path.parent) == ["secret_key"]  # no temporary file left behind
    path.unlink()
    assert load_secret_key("", debug=False, path=path) != first  # another install, another key


def test_a_given_key_is_used_and_the_public_one_refused_without_debug(tmp_path):
    path = tmp_path / "secret_key"
    assert load_secret_key("a-key-of-my-own", debug=False, path=path) == "a-key-of-my-own"
    with pytest.raises(ImproperlyConfigured, match="public default key"):
        load_secret_key(PUBLIC_KEY, debug=False, path=path)
    assert load_secret_key(PUBLIC_KEY, debug=True, path=path) == PUBLIC_KEY
    assert not path.exists()


def test_an_unusable_key_file_stops_the_process_with_a_clear_message(tmp_path):
    path = tmp_path / "secret_key"
    path.write_text("short\n")
    with pytest.raises(ImproperlyConfigured, match="no key of at least"):
        load_secret_key("", debug=False, path=path)
    blocked = tmp_path / "a-file" / "secret_key"
    blocked.parent.write_text("")  # its folder cannot be made
    with pytest.raises(ImproperlyConfigured, match="SECRET_KEY_FILE"):
        load_secret_key("", debug=False, path=blocked)


def test_a_key_file_others_can_read_is_made_private(tmp_path):
    path = tmp_path / "secret_key"
    path.write_text("k" * 64 + "\n")
    path.chmod(0o644)
    assert load_secret_key("", debug=False, path=path) == "k" * 64
    assert mode(path) == 0o600


def _load_at_once(barrier, path: str, results) -> None:
    barrier.wait()
    results.put(load_secret_key("", debug=False, path=path))


@pytest.mark.process
def test_processes_starting_together_agree(tmp_path):
    path = tmp_path / "secret_key"
    ctx = multiprocessing.get_context("fork")
    n = 8
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_load_at_once, args=(barrier, str(path), results))
             for _ in range(n)]
    for p in procs:
        p.start()
    keys = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    assert len(set(keys)) == 1 and keys[0] == path.read_text().strip()
    assert os.listdir(tmp_path) == ["secret_key"] and mode(path) == 0o600


ENTRY_POINTS = {
    # How daphne, Celery and manage.py load the settings.
    "daphne": [sys.executable, "-c", "import llm_platform.asgi; from django.conf import settings;"
               " print(settings.SECRET_KEY)"],
    "celery": [sys.executable, "-c", "from llm_platform import celery_app;"
               " celery_app.loader.import_default_modules();"
               " from django.conf import settings; print(settings.SECRET_KEY)"],
    "manage.py": [sys.executable, "manage.py", "shell", "-c",
                  "from django.conf import settings; print(settings.SECRET_KEY)"],
}


def _environment(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG")}
    env["DJANGO_SETTINGS_MODULE"] = "llm_platform.settings"
    for name, value in changes.items():
        if value is not None:
            env[name] = value
    return env


@pytest.mark.process
def test_every_process_of_an_install_signs_with_its_one_generated_key(tmp_path):
    path = tmp_path / "secret_key"
    env = _environment(SECRET_KEY_FILE=str(path))
    procs = {name: subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, args in ENTRY_POINTS.items()}  # started together
    keys = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, err[-2000:])
        keys[name] = out.strip().splitlines()[-1]
    assert path.is_file() and mode(path) == 0o600
    assert set(keys.values()) == {path.read_text().strip()}, keys
    # A later run reads it again.
    again = subprocess.run(ENTRY_POINTS["manage.py"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
    assert again.stdout.strip().splitlines()[-1] == keys["daphne"]


@pytest.mark.process
def test_the_public_key_does_not_start_without_debug(tmp_path):
    show = [sys.executable, "-c", "import django; django.setup();"
            " from django.conf import settings; print(settings.SECRET_KEY)"]
    refused = subprocess.run(show, cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=_environment(SECRET_KEY=PUBLIC_KEY))
    assert refused.returncode != 0
    assert "ImproperlyConfigured" in refused.stderr and "public default key" in refused.stderr
    debugging = subprocess.run(show, cwd=REPO, capture_output=True, text=True, timeout=120,
                               env=_environment(SECRET_KEY=PUBLIC_KEY, DEBUG="true"))
    assert debugging.returncode == 0, debugging.stderr[-2000:]


def _messages_cookie(key: str, text: str) -> str:
    """A ``messages`` cookie as Django's cookie storage writes it, signed with ``key``."""
    storage = CookieStorage(HttpRequest())
    storage.signer = signing.TimestampSigner(key=b"django.http.cookies" + key.encode(),
                                             salt=CookieStorage.key_salt)
    return storage._encode([Message(constants.ERROR, text)])


@pytest.mark.django_db
def test_a_cookie_forged_with_the_public_key_is_not_accepted(client):
    client.cookies["messages"] = _messages_cookie(PUBLIC_KEY, "Forged-by-a-stranger")
    assert b"Forged-by-a-stranger" not in client.get("/admin/login/").content
    # The same cookie signed with the install's key is shown: the check above means something.
    client.cookies["messages"] = _messages_cookie(settings.SECRET_KEY, "Signed-by-this-install")
    assert b"Signed-by-this-install" in client.get("/admin/login/").content
