"""`nanoserve generate` end to end on the CPU with the embedded model."""

from __future__ import annotations

from click.testing import CliRunner

from nanoserve.cli import main


def test_generate_synthetic_prompt_reports_timings():
    r = CliRunner().invoke(main, ["generate", "--input-len", "100", "--output-len", "5",
                                  "--batch-size", "2", "--page-size", "16"])
    assert r.exit_code == 0, r.output
    assert "requests 2  prompt tokens 200  output tokens 10" in r.output
    assert "TTFT" in r.output and "TPOT" in r.output


def test_generate_rejects_bad_sampling_parameter():
    r = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--top-p", "1.5"])
    assert r.exit_code == 2 and "top_p must be in (0, 1]" in r.output


def test_generate_reports_prompt_over_max_model_len():
    r = CliRunner().invoke(main, ["generate", "--prompt", "x" * 64, "--max-model-len", "32"])
    assert r.exit_code == 1 and "max_model_len is 32" in r.output


def test_generate_missing_model_is_a_clear_error(tmp_path):
    r = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "missing.bin")])
    assert r.exit_code == 1 and "neither a local directory" in r.output


def test_help_documents_every_option():
    r = CliRunner().invoke(main, ["generate", "--help"])
    for opt in ("--model", "--prompt", "--input-len", "--output-len", "--batch-size",
                "--temperature", "--top-k", "--top-p", "--seed", "--enforce-eager",
                "--dummy-weights", "--gpu-kv-budget", "--max-model-len", "--enable-offload"):
        assert opt in r.output


def test_generate_with_offload_prints_the_split():
    r = CliRunner().invoke(main, ["generate", "--input-len", "300", "--output-len", "4",
                                  "--page-size", "16", "--enable-offload", "--resident-layers",
                                  "1", "--host-kv-budget", "0.01"])
    assert r.exit_code == 0, r.output
    assert "1 of 4 layers resident, 3 streamed" in r.output
