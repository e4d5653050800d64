"""EngineConfig is the one place engine settings are declared (issue 12, fault 5): the CLI's
engine options are made from its fields, bench_offload.py takes its defaults from it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from nanoserve.cli import engine_options, main
from nanoserve.config import EngineConfig, config_default
from nanoserve.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_offload  # noqa: E402

FIELDS = dataclasses.fields(EngineConfig)
ALIASES = {"gpu_kv_budget_gib": "--gpu-kv-budget", "host_kv_budget_gib": "--host-kv-budget"}
SIZED = {"generate": {"max_num_seqs"}, "serve": set()}  # sized by the command when not given
# a valid value other than the default for every field: (command-line text, config value)
VALUES = {"model": ("some-model", "some-model"), "dtype": ("fp16", "float16"),
          "kv_cache_dtype": ("fp8", "fp8"),
          "device": ("cpu", "cpu"), "page_size": ("16", 16), "max_num_seqs": ("3", 3),
          "max_num_batched_tokens": ("100", 100), "max_model_len": ("128", 128),
          "gpu_memory_utilization": ("0.5", 0.5), "gpu_kv_budget_gib": ("1.5", 1.5),
          "enforce_eager": (None, True), "enable_fusion": (None, False),
          "async_scheduling": (None, False),
          "max_graph_batch_size": ("8", 8), "tensor_parallel_size": ("2", 2),
          "attention_backend": ("torch", "torch"), "moe_backend": ("loop", "loop"),
          "dummy_weights": (None, True),
          "seed": ("7", 7), "enable_prefix_caching": (None, False),
          "enable_offload": (None, True), "host_kv_budget_gib": ("2.5", 2.5),
          "num_kv_buffers": ("3", 3), "resident_layers": ("1", 1),
          "cpu_attention": ("0.4", "0.4")}


def option_name(f: dataclasses.Field) -> str:
    return ALIASES.get(f.name, "--" + f.name.replace("_", "-"))


def switch_name(f: dataclasses.Field) -> str:
    """The option that sets a non-default value: --no-X for a flag that defaults to on."""
    return "--no-" + option_name(f)[2:] if f.default is True else option_name(f)


def engine_params(command: str) -> dict[str, click.Option]:
    return {p.name: p for p in main.commands[command].params}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_field_has_an_option_with_the_configs_default_and_help(command):
    params = engine_params(command)
    for f in FIELDS:
        opt = params[f.name]  # the option's value arrives under the field's name
        assert opt.opts == [option_name(f)]
        want = None if f.name in SIZED[command] else f.default
        assert opt.default == want, f.name
        assert opt.help.startswith(f.metadata["help"]), f.name
        assert opt.is_flag == isinstance(f.default, bool), f.name
        assert opt.show_default == (want not in (None, "")) or opt.is_flag, f.name


def test_help_shows_the_configs_defaults():
    out = " ".join(CliRunner().invoke(main, ["generate", "--help"]).output.split())
    assert "--max-graph-batch-size" in out
    for text in ("[default: 8192; x>=1]", "[default: 0.9;", "[default: --batch-size]",
                 "[auto|flash|triton|torch]"):
        assert text in out, text


def test_the_config_helper_reads_the_dataclass():
    assert [config_default(f.name) for f in FIELDS] == [f.default for f in FIELDS]
    with pytest.raises(KeyError):
        config_default("nope")


class Captured(Exception):
    pass


@pytest.fixture
def captured(monkeypatch):
    """The config a command hands LLM.from_config (no model gets loaded)."""
    got = []

    def capture(cfg, *a, **k):
        got.append(cfg)
        raise Captured

    monkeypatch.setattr(LLM, "from_config", capture)
    return got


def run(*args: str):
    r = CliRunner().invoke(main, list(args))
    assert isinstance(r.exception, Captured), r.output
    return r


def test_max_graph_batch_size_reaches_the_config(captured):
    run("generate", "--prompt", "hi", "--max-graph-batch-size", "8")
    assert captured[-1].max_graph_batch_size == 8
    run("generate", "--prompt", "hi")
    assert captured[-1].max_graph_batch_size == config_default("max_graph_batch_size")


def test_max_graph_batch_size_is_checked_before_loading(captured):
    r = CliRunner().invoke(main, ["generate", "--max-graph-batch-size", "0"])
    assert r.exit_code == 2 and not captured
    assert "Invalid value for '--max-graph-batch-size': 0 is not in the range x>=1." in r.output


def test_every_option_reaches_the_config(captured):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    assert set(VALUES) == {f.name for f in FIELDS}
    args = [a for f in FIELDS for a in (switch_name(f), VALUES[f.name][0]) if a is not None]
    run("serve", *args)
    assert captured[-1] == EngineConfig(**{name: v for name, (_, v) in VALUES.items()})
    run("serve")
    assert captured[-1] == EngineConfig()


def test_generate_sizes_the_engine_when_not_told(captured):
    run("generate", "--input-len", "40", "--output-len", "8", "--batch-size", "3")
    assert (captured[-1].max_num_seqs, captured[-1].max_model_len) == (3, 48)
    run("generate", "--input-len", "40", "--output-len", "8", "--batch-size", "3",
        "--max-num-seqs", "5", "--max-model-len", "100")
    assert (captured[-1].max_num_seqs, captured[-1].max_model_len) == (5, 100)
    run("generate", "--prompt", "hi")  # a prompt of its own: the model's maximum
    assert (captured[-1].max_num_seqs, captured[-1].max_model_len) == (1, None)


def test_bare_engine_options_leave_max_num_seqs_to_the_command():
    cmd = click.command()(engine_options(lambda **kw: None))
    params = {p.name: p for p in cmd.params}
    assert params["max_num_seqs"].default is None
    assert params["page_size"].default == config_default("page_size")


def test_bench_takes_its_engine_defaults_from_the_config():
    args = bench_offload.parse_args([])
    assert args.gpu_kv_budget == config_default("gpu_kv_budget_gib")
    assert args.dummy_weights == config_default("dummy_weights")
    assert args.resident_layers == 0  # the bench's own: every layer streams
    assert args.kv_cache_dtype == config_default("kv_cache_dtype")
    assert bench_offload.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    args = bench_offload.parse_args(["--resident-layers", "-1"])
    assert args.resident_layers == config_default("resident_layers")
