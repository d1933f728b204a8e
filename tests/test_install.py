"""`pip install .` into an environment that already has torch and fairseq, then --user-dir at the installed copy.

The user's environment is a fresh virtual environment whose torch, fairseq and their
dependencies are this repository's pinned ones, reached through a .pth file (as a
system-wide or conda install would be), without the plugin and without scripts/setup.sh.
"""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from cli_support import ENV, hypotheses, run, trained
from conftest import PLUGIN

ROOT = os.path.dirname(PLUGIN)
# Left out of the user's stack: the plugin (the editable install of this checkout) and
# the build tools, which a new virtual environment brings its own of.
NOT_THE_USERS = ("fairseq_bpd", "__editable__", "pip", "setuptools", "wheel", "_distutils_hack",
                 "distutils-precedence.pth", "pkg_resources", "__pycache__")


def users_stack(directory):
    """A folder of links to this environment's packages but the plugin and build tools."""
    os.makedirs(directory)
    site = sysconfig.get_paths()["purelib"]
    for name in os.listdir(site):
        if not name.startswith(NOT_THE_USERS):
            os.symlink(os.path.join(site, name), os.path.join(directory, name))
    return directory


def python(env, *args):
    """Run `env`'s Python outside this checkout (where `import fairseq_bpd` would find it); the finished process."""
    process = subprocess.run([os.path.join(env, "bin", "python"), *map(str, args)], capture_output=True,
                             text=True, env=ENV, timeout=600, cwd=os.path.dirname(env))
    assert process.returncode == 0, f"exited {process.returncode}:\n{(process.stdout + process.stderr)[-4000:]}"
    return process


def printed(env, code):
    """The last line a Python snippet prints to stdout in `env` (fairseq logs to stderr)."""
    return python(env, "-c", code).stdout.splitlines()[-1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A new virtual environment with the user's stack and the plugin pip-installed from a copy of the checkout."""
    root = tmp_path_factory.mktemp("install")
    env = str(root / "env")
    subprocess.run([sys.executable, "-m", "venv", env], check=True, timeout=300)
    stack = users_stack(str(root / "stack"))
    env_site = printed(env, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    with open(os.path.join(env_site, "users-stack.pth"), "w") as f:
        f.write(stack + "\n")
    source = root / "source"  # pip builds in the source tree: not in this checkout
    source.mkdir()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), source)
    shutil.copytree(PLUGIN, source / "fairseq_bpd", ignore=shutil.ignore_patterns("__pycache__"))
    before = printed(env, "import torch, fairseq; print(torch.__version__, torch.__file__, fairseq.__file__)")
    python(env, "-m", "pip", "install", "--disable-pip-version-check", str(source))
    return env, env_site, stack, before


def test_pip_install_leaves_torch_and_fairseq_alone(installed):
    env, env_site, stack, before = installed
    after = printed(env, "import torch, fairseq; print(torch.__version__, torch.__file__, fairseq.__file__)")
    assert after == before
    assert f"{stack}/torch/" in after and f"{stack}/fairseq/" in after
    assert not any(name.startswith(("torch", "fairseq-", "fairseq_cli")) or name == "fairseq"
                   for name in os.listdir(env_site)), os.listdir(env_site)
    where = printed(env, "import fairseq_bpd; print(fairseq_bpd.__file__)")
    assert where == os.path.join(env_site, "fairseq_bpd", "__init__.py")


def test_user_dir_at_the_installed_copy_decodes_as_greedy(installed, tmp_path_factory):
    env, env_site, _, _ = installed
    tiny = trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))
    user_dir = printed(env, "import fairseq_bpd, os; print(os.path.dirname(fairseq_bpd.__file__))")
    assert user_dir == os.path.join(env_site, "fairseq_bpd")
    common = [tiny.data, "--path", tiny.checkpoint, "--task", "translation_blockwise", "--gen-subset", "test",
              "--cpu", "--max-tokens", "500"]
    process = python(env, "-m", "fairseq_cli.generate", *common, "--user-dir", user_dir, "--blockwise")
    blockwise = process.stdout + process.stderr
    greedy = run("fairseq-generate", *common, "--user-dir", PLUGIN, "--beam", "1")  # fairseq's own search
    assert hypotheses(blockwise) and {i: t for i, (_, t) in hypotheses(blockwise).items()} == {
        i: t for i, (_, t) in hypotheses(greedy).items()}
    assert "blockwise:" in blockwise  # the installed plugin's generator ran
