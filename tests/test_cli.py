"""`nanoserve generate` / `serve` end to end on the CPU with the embedded model, and the checks
that refuse bad input before any model is loaded."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from click.testing import CliRunner
from conftest import make_hf_model

import nanoserve
from nanoserve.cli import main
from nanoserve.llm import LLM
from nanoserve.models import loader
from nanoserve.text import format_bytes

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a model gets loaded: bad input must be refused before."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(LLM, "from_config", refuse)


def usage_error(r) -> str:
    """The 'Error: ...' line of a click usage error (exit 2, no traceback)."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.exception is None or \
        isinstance(r.exception, SystemExit), r.output
    assert r.stderr.startswith("Usage: ") and r.stdout == ""
    return r.stderr.splitlines()[-1]


def test_generate_synthetic_prompt_reports_timings():
    r = invoke("generate", "--input-len", "100", "--output-len", "5", "--batch-size", "2",
               "--page-size", "16")
    assert r.exit_code == 0, r.output
    assert "requests 2  prompt tokens 200  output tokens 10" in r.output
    assert "TTFT" in r.output and "TPOT" in r.output


def test_generate_rejects_bad_sampling_parameter(no_loading):
    assert usage_error(invoke("generate", "--prompt", "hi", "--top-p", "1.5")).startswith(
        "Error: top_p must be")


def test_generate_reports_prompt_over_max_model_len():
    r = invoke("generate", "--prompt", "x" * 64, "--max-model-len", "32", "--output-len", "4")
    assert r.exit_code == 1 and "max_model_len is 32" in r.stderr


def test_generate_missing_model_is_a_clear_error(tmp_path):
    r = invoke("generate", "--model", str(tmp_path / "missing.bin"))
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.startswith(f"error: model directory '{tmp_path / 'missing.bin'}' does not "
                               f"exist") and r.stderr.count("\n") == 1


def test_help_documents_every_option():
    r = invoke("generate", "--help")
    for opt in ("--model", "--prompt", "--input-len", "--output-len", "--batch-size",
                "--temperature", "--top-k", "--top-p", "--seed", "--enforce-eager",
                "--dummy-weights", "--gpu-kv-budget", "--max-model-len", "--enable-offload"):
        assert opt in r.output
    assert "0 to 2, 0 is greedy." in r.output


def test_generate_with_offload_prints_the_split():
    r = invoke("generate", "--input-len", "300", "--output-len", "4", "--page-size", "16",
               "--enable-offload", "--resident-layers", "1", "--host-kv-budget", "0.01")
    assert r.exit_code == 0, r.output
    assert "1 of 4 layers resident, 3 streamed" in r.output


def test_a_small_device_budget_streams_on_the_cpu_and_finds_the_same_needle():
    """--gpu-kv-budget applies on a CPU: 1.25 MiB holds the ring slots (2 x 22 pages of 16 KiB),
    the streamed layers' tails and one resident layer's pages, not all 4 layers' (1.375 MiB)."""
    common = ("generate", "--input-len", "300", "--output-len", "32", "--page-size", "16")
    off = invoke(*common)
    r = invoke(*common, "--enable-offload", "--gpu-kv-budget", str(1.25 / 1024))
    assert off.exit_code == 0 and r.exit_code == 0, r.output
    assert "; 1 of 4 layers resident, 3 streamed, 1.03 MB per decode step at full capacity " \
           "(21 pages)\n" in r.output  # 3 layers x 21 pages x 16 KiB
    assert "needle: the answer found the secret number" in r.output
    text = off.output.split("-" * 80)[1]
    assert r.output.split("-" * 80)[1] == text  # greedy: offload on and off answer alike
    n_out = int(r.output.split("output tokens ")[1].split()[0])
    pages = (300 + n_out - 2) // 16  # the last decode step writes position 300 + n_out - 2
    assert f"offload: 1 of 4 layers resident, 3 streamed; the last decode step streamed " \
           f"{format_bytes(3 * pages * 16 * 1024)} host->device ({pages} pages of each " \
           f"streamed layer)\n" in r.output
    assert "offload:" not in off.output


def test_version_prints_the_package_version():
    r = invoke("--version")
    assert r.exit_code == 0
    assert r.output == f"nanoserve {importlib.metadata.version('nanoserve')}\n"
    assert importlib.metadata.version("nanoserve") == nanoserve.__version__


# --- issue 10 item 1: hub ids with a dot ----------------------------------------------------------
def test_generate_takes_a_dotted_hub_id(monkeypatch, tmp_path):
    make_hf_model("qwen3", tmp_path)
    calls = []

    def fake_snapshot_download(repo, allow_patterns=None, **kw):
        calls.append(repo)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    r = invoke("generate", "--model", "Qwen/Qwen3-0.6B", "--input-len", "8", "--output-len",
               "2", "--page-size", "16")
    assert r.exit_code == 0, r.output
    assert calls == ["Qwen/Qwen3-0.6B"]  # resolved once, by the CLI
    assert f"model: {tmp_path} (qwen3, 3 layers)" in r.stdout
    assert "requests 1  prompt tokens 8  output tokens 2" in r.stdout


# --- issue 10 item 2: a model that cannot fit is refused up front --------------------------------
def test_generate_refuses_a_model_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(loader, "available_memory", lambda device: 24 * GiB)

    def no_build(*a, **k):
        raise AssertionError("weights were built")

    monkeypatch.setattr(loader, "build_model", no_build)
    r = invoke("generate", "--model", "Qwen3-8B", "--dummy-weights", "--dtype", "float32",
               "--device", "cpu")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr == (
        "error: the model does not fit: its weights need 32.8 GB (30.5 GiB) in float32 but "
        "only 25.8 GB (24.0 GiB) of RAM is available (MemAvailable); use --dtype bfloat16 "
        "(dtype='bfloat16'), which needs 16.4 GB (15.3 GiB)\n")


# --- issue 10 items 3 and 4: bad arguments are usage errors, before loading ----------------------
@pytest.mark.parametrize("args, message", [
    (["--input-len", "-5"], "Error: Invalid value for '--input-len': -5 is not in the range "
                            "x>=1."),
    (["--input-len", "0"], "Error: Invalid value for '--input-len': 0 is not in the range x>=1."),
    (["--output-len", "0"], "Error: Invalid value for '--output-len': 0 is not in the range "
                            "x>=1."),
    (["--batch-size", "0"], "Error: Invalid value for '--batch-size': 0 is not in the range "
                            "x>=1."),
    (["--max-model-len", "1"], "Error: Invalid value for '--max-model-len': 1 is not in the "
                               "range x>=2."),
    (["--max-model-len", "100", "--input-len", "100"],
     "Error: --input-len 100 + --output-len 64 = 164 tokens do not fit --max-model-len 100"),
    (["--max-model-len", "64", "--output-len", "64"],
     "Error: --output-len 64 does not fit --max-model-len 64: prompt and output share it, so "
     "the output can be at most 63 tokens"),
    (["--output-len", "70000"],
     "Error: --output-len 70000 does not fit the model's context length 65536 "
     "(max_position_embeddings): prompt and output share it, so the output can be at most "
     "65535 tokens"),
    (["--input-len", "65000", "--output-len", "1000"],
     "Error: --input-len 65000 + --output-len 1000 = 66000 tokens do not fit the model's "
     "context length 65536 (max_position_embeddings)"),
    (["--gpu-kv-budget", "inf"], "Error: Invalid value for '--gpu-kv-budget': inf is not a "
                                 "finite number."),
    (["--gpu-kv-budget", "nan"], "Error: Invalid value for '--gpu-kv-budget': nan is not a "
                                 "finite number."),
    (["--gpu-kv-budget", "-1"], "Error: Invalid value for '--gpu-kv-budget': -1.0 is not in "
                                "the range x>=0."),
    (["--host-kv-budget", "0"], "Error: Invalid value for '--host-kv-budget': 0.0 is not in the "
                                "range x>0."),
    (["--prompt", ""], "Error: --prompt is empty: give the prompt text, or leave --prompt out "
                       "for the default needle prompt"),
    (["--prompt", "hi", "--input-len", "10"],
     "Error: --prompt and --input-len exclude each other: give one"),
])
def test_generate_refuses_bad_arguments_before_loading(no_loading, args, message):
    assert usage_error(invoke("generate", *args)) == message


def test_generate_refuses_an_unknown_device(no_loading):
    line = usage_error(invoke("generate", "--device", "foo"))
    assert line.startswith("Error: ") and "'foo'" in line


def test_generate_temperature_beyond_2_is_refused(no_loading):
    line = usage_error(invoke("generate", "--prompt", "hi", "--temperature", "2.5"))
    assert line.startswith("Error: temperature must be")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_generate_device_cuda_without_cuda_is_one_clear_line():
    r = subprocess.run([sys.executable, "-m", "nanoserve.cli", "generate", "--device", "cuda"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr
    last = r.stderr.splitlines()[-1]
    assert last.startswith("Error: ") and "cuda" in last.lower(), r.stderr


@pytest.mark.parametrize("args, message", [
    (["--port", "-1"], "Error: Invalid value for '--port': -1 is not in the range "
                       "1<=x<=65535."),
    (["--port", "70000"], "Error: Invalid value for '--port': 70000 is not in the range "
                          "1<=x<=65535."),
    (["--default-max-tokens", "0"], "Error: Invalid value for '--default-max-tokens': 0 is "
                                    "not in the range x>=1."),
    (["--gpu-kv-budget", "inf"], "Error: Invalid value for '--gpu-kv-budget': inf is not a "
                                 "finite number."),
    (["--header-timeout", "0"], "Error: Invalid value for '--header-timeout': 0.0 is not in "
                                "the range 0<x<=3600."),
    (["--max-connections", "0"], "Error: Invalid value for '--max-connections': 0 is not in "
                                 "the range x>=1."),
])
def test_serve_refuses_bad_arguments_before_loading(no_loading, args, message):
    assert usage_error(invoke("serve", *args)) == message


def test_serve_empty_allowed_hosts_is_a_usage_error(no_loading):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    assert usage_error(invoke("serve", "--allowed-hosts", " , ")) == \
        "Error: allowed hosts: give at least one name, or '*' for any"


def test_serve_bad_device_is_a_usage_error(no_loading):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    line = usage_error(invoke("serve", "--device", "foo"))
    assert line.startswith("Error: ") and "'foo'" in line


# --- issue 10 item 5: the default demo shows its prompt ------------------------------------------
def test_generate_default_is_a_needle_prompt_it_shows():
    r = invoke("generate")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    i = lines.index("prompt: a 1,024-token needle-in-a-haystack prompt (the default demo; "
                    "--prompt TEXT or --input-len N for your own)")
    assert lines[i + 1:i + 6] == [
        '  filler sentences hide "The secret number is: 985440." at depth 0.50 (token 463), '
        'then the question:',
        "  What is the secret number in the text above?",
        "-" * 80,
        "The secret number is: 985440.",
        "-" * 80]
    assert lines[i + 6] == "needle: the answer found the secret number 985440"
    assert "requests 1  prompt tokens 1024  output tokens" in r.stdout


def test_generate_prints_the_prompt_before_the_output():
    r = invoke("generate", "--prompt", "The grass is green and", "--output-len", "4")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    i = lines.index("prompt: The grass is green and")
    assert lines[i + 1] == "-" * 80 and lines[i + 3] == "-" * 80


def test_generate_needle_batch_reports_every_request():
    r = invoke("generate", "--input-len", "512", "--batch-size", "2", "--output-len", "40")
    assert r.exit_code == 0, r.output
    assert "prompt: a 512-token needle-in-a-haystack prompt\n" in r.stdout
    assert "  request 1 of 2: filler sentences hide" in r.stdout
    assert "needle: the answers found the secret number in 2 of 2 requests" in r.stdout
