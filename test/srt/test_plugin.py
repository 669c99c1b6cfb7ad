"""The SGLang plugin and CPU platform, against the real SGLang 0.5.23 package."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.sglang


def test_register_is_idempotent_and_adds_the_flag_group() -> None:
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_vericache.srt import plugin

    load_plugins()  # runs our entry point, as every SGLang process does
    plugin.register()
    plugin.register()
    HookRegistry.apply_hooks()
    ours = [h for h in resolution_hooks._HOOKS.get("handle_missing_default_values", [])
            if h is plugin._cpu_device_default]  # fmt: skip
    assert len(ours) == 1

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)  # a second registration would raise "conflicting option"
    ns = parser.parse_args(["--model-path", "m", "--vericache-draft-len", "8"])
    assert ns.vericache_draft_len == "8" and ns.vericache is False
    titles = [g.title for g in parser._action_groups]
    assert titles.count("VeriCache") == 1


def test_cpu_platform_activates_only_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_vericache.srt.platform import PLATFORM_QUALNAME, activate

    assert not torch.cuda.is_available(), "this test documents the CPU machine it runs on"
    assert activate() == PLATFORM_QUALNAME
    # No CUDA device here, so the CUDA branch is exercised through torch's own query.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert activate() is None


def test_sglang_resolves_our_platform_here() -> None:
    from sglang.srt.platforms import current_platform

    from sglang_vericache.srt.platform import TorchCpuPlatform

    assert isinstance(current_platform, TorchCpuPlatform)
    assert current_platform.get_default_attention_backend() == "torch_native"


def test_importing_our_platform_first_still_resolves_it() -> None:
    """SGLang's first import resolves its platform through our entry point; were our platform
    module the first to import SGLang, the entry point would be half-imported then and SGLang
    would fall back to its base platform for the whole process (CI caught this through a test
    module that imports the platform at collection)."""
    check = (
        "import sglang_vericache.srt.platform as ours\n"
        "from sglang.srt.platforms import current_platform as p\n"
        "assert isinstance(p, ours.TorchCpuPlatform), p\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "partially initialized" not in done.stderr


BAD_FLAGS = [
    (["--vericache-compressor", "nonsense"], ["--vericache-compressor", "streaming", "kivi"]),
    (["--vericache-tier", "disk"], ["--vericache-tier", "zmq://HOST:PORT"]),
    (["--vericache-draft-len", "65"], ["--vericache-draft-len", "auto", "0..64"]),
    (["--vericache", "--radix-cache-backend", "radix"], ["--radix-cache-backend", "host memory"]),
]


@pytest.fixture(scope="module")
def launches() -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    """``python -m sglang.launch_server ARGS`` for --help and every bad flag, all at once:
    each is mostly SGLang's import (~15 s on 2 cores), so one after another they took a minute
    more."""
    argvs = [("--help",), *(tuple(args) for args, _ in BAD_FLAGS)]
    procs = {argv: subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *argv],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in argvs}  # fmt: skip
    out = {}
    for argv, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=240)
        out[argv] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def test_help_shows_the_vericache_group(launches) -> None:
    proc = launches["--help",]
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("VeriCache:", "--vericache", "--vericache-compressor", "--vericache-draft-len",
                 "--vericache-tier"):  # fmt: skip
        assert flag in proc.stdout


@pytest.mark.parametrize("args, fragments", BAD_FLAGS)
def test_bad_flag_fails_at_start_up_naming_the_flag(launches, args: list[str],
                                                    fragments: list[str]) -> None:  # fmt: skip
    proc = launches[tuple(args)]
    assert proc.returncode == 2
    for fragment in fragments:
        assert fragment in proc.stderr
    assert "Load weight" not in proc.stderr  # it failed before any model loaded
