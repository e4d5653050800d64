"""`nanoserve` command line: `nanoserve generate ...`."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
import typing
from typing import NoReturn

import click

from nanoserve.config import EngineConfig
from nanoserve.distributed.workers import TensorParallelFailure
from nanoserve.sampling_params import SamplingParams
from nanoserve.text import format_bytes, plural

if typing.TYPE_CHECKING:
    from nanoserve.kv.manager import KVManager

DEMO_INPUT_LEN = 1024  # generate with neither --prompt nor --input-len: a needle prompt this long


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses inf and nan (click's FloatRange lets both through)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number.", param, ctx)
        return rv


def fail(e: BaseException) -> NoReturn:
    """An error that is not a usage error: one line on stderr, exit status 1."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    click.echo(f"error: {msg}", err=True)
    sys.exit(1)


def engine_options(f=None, /, **sized: str):
    """The options of every command that builds an engine: one per EngineConfig field, with the
    field's default, help and range. `sized`: fields the command sizes itself when their option
    is not given (their default is None here), each with a note for the help. Bare
    `@engine_options` leaves max_num_seqs to the command (the needle script in
    tests/test_needle.py sizes it to 1)."""
    if f is None:
        return lambda f: _add_engine_options(f, sized)
    return _add_engine_options(f, {"max_num_seqs": "default: sized by the command"})


def _add_engine_options(f, sized: dict[str, str]):
    hints = typing.get_type_hints(EngineConfig)
    for fld in reversed(dataclasses.fields(EngineConfig)):
        meta, kind = fld.metadata, hints[fld.name]
        kind = next((t for t in typing.get_args(kind) if t is not type(None)), kind)  # Optional
        name = "--" + meta.get("name", fld.name.replace("_", "-"))
        if kind is bool:
            flag = f"{name}/--no-{name[2:]}" if fld.default else name
            f = click.option(flag, fld.name, is_flag=True, default=fld.default,
                             help=meta["help"])(f)
            continue
        bounds = {k: meta[k] for k in ("min", "max", "min_open") if k in meta}
        kind = (click.Choice(meta["choices"]) if "choices" in meta else FiniteFloat(**bounds)
                if kind is float else click.IntRange(**bounds) if kind is int and bounds else kind)
        default = None if fld.name in sized else fld.default
        note = f" [{sized[fld.name]}]" if fld.name in sized else ""
        f = click.option(name, fld.name, type=kind, default=default, help=meta["help"] + note,
                         show_default=default not in (None, ""))(f)
    return f


def build_config(kw: dict) -> EngineConfig:
    """The config of the engine options in `kw`; those still None keep the config's default."""
    return EngineConfig(**{k: v for k, v in kw.items() if v is not None})


@click.group()
@click.version_option(package_name="nanoserve", prog_name="nanoserve",
                      message="%(prog)s %(version)s")
def main() -> None:
    """nanoserve: a long-context LLM inference engine."""


@main.command()
@engine_options(max_num_seqs="default: --batch-size",
                max_model_len="without --prompt: input + output length")
@click.option("--prompt", default=None,
              help="Prompt text (needs a model with a tokenizer). With neither --prompt nor "
                   f"--input-len: a {DEMO_INPUT_LEN:,}-token needle-in-a-haystack prompt.")
@click.option("--input-len", type=click.IntRange(min=1), default=None,
              help="A synthetic prompt of exactly this many tokens instead of --prompt: a "
                   "needle-in-a-haystack prompt for a model with a tokenizer and real weights "
                   "(the answer shows whether it read the context), random tokens otherwise.")
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens to generate per request.")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests to run together.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 to 2, 0 is greedy.")
@click.option("--top-k", type=int, default=-1, show_default=True, help="-1: off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="In (0, 1].")
@click.option("--ignore-eos/--stop-at-eos", default=None,
              help="Default: ignore EOS with random-token prompts (fixed-length benchmark "
                   "runs), stop at EOS otherwise.")
def generate(prompt, input_len, output_len, batch_size, temperature, top_k, top_p, ignore_eos,
             **kw) -> None:
    """Generate from one prompt (or a batch of synthetic prompts) and report timings.

    With neither --prompt nor --input-len it runs a short needle-in-a-haystack prompt (a
    secret number hidden in filler text, then a question about it) and shows whether the
    answer found the number."""
    import torch

    from nanoserve.llm import LLM
    from nanoserve.models.config import ModelConfig
    from nanoserve.models.loader import resolve_model_dir

    if prompt == "":
        raise click.UsageError("--prompt is empty: give the prompt text, or leave --prompt "
                               "out for the default needle prompt")
    if prompt is not None and input_len is not None:
        raise click.UsageError("--prompt and --input-len exclude each other: give one")
    limit = kw["max_model_len"]
    if limit is not None:  # checks that need no model
        check_lengths(input_len, output_len, limit, f"--max-model-len {limit}")
    kw["max_num_seqs"] = kw["max_num_seqs"] or batch_size
    try:
        cfg = build_config(kw)
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=output_len)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        model_dir = resolve_model_dir(cfg.model, cfg.dummy_weights)
        model_max = ModelConfig.from_dir(model_dir).max_position_embeddings
    except (ValueError, OSError, KeyError, TensorParallelFailure) as e:
        fail(e)
    demo = prompt is None and input_len is None
    if limit is None:
        # the model's context binds, except a synthetic prompt with dummy weights, which may
        # run a real model's shape beyond it (benchmarks)
        synthetic = input_len is not None or demo
        if not (cfg.dummy_weights and synthetic):
            check_lengths(input_len, output_len, model_max,
                          f"the model's context length {model_max} (max_position_embeddings)")
    if demo:
        input_len = min(DEMO_INPUT_LEN, (limit or model_max) - output_len)
    if input_len is not None and limit is None:  # size the engine to the workload
        cfg = dataclasses.replace(cfg, max_model_len=input_len + output_len)
    cfg = dataclasses.replace(cfg, model=str(model_dir))  # resolved once: no second hub call
    try:
        llm = LLM.from_config(cfg)
    except (ValueError, OSError, KeyError, TensorParallelFailure) as e:
        fail(e)
    engine = llm.engine
    needles, why_random = [], ""
    if input_len is not None:
        if engine.tokenizer is None:
            why_random = "the model has no tokenizer"
        elif cfg.dummy_weights:
            why_random = "dummy weights cannot read a needle prompt"
        else:  # a model that can read gets a needle prompt: its answer shows it read it
            from nanoserve.needle import NeedleBuilder

            builder, rng = NeedleBuilder(engine.tokenizer), random.Random(kw["seed"])
            try:
                needles = [builder.build(input_len, (i + 0.5) / batch_size, rng)
                           for i in range(batch_size)]
            except ValueError:
                why_random = f"a needle prompt needs more than {plural(input_len, 'token')}"
        prompts = [n.token_ids for n in needles]
    if input_len is not None and not needles:
        vocab = engine.model_config.vocab_size
        if engine.tokenizer is not None:
            vocab = min(vocab, len(engine.tokenizer))
        g = torch.Generator().manual_seed(kw["seed"])
        prompts = [torch.randint(0, vocab, (input_len,), generator=g).tolist()
                   for _ in range(batch_size)]
    elif input_len is None:
        prompts = [prompt] * batch_size
    if ignore_eos is None:  # random-token benchmark prompts run to --output-len
        ignore_eos = input_len is not None and not needles
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            max_tokens=output_len, seed=kw["seed"], ignore_eos=ignore_eos)
    click.echo(f"model: {engine.model_dir} ({engine.model_config.architecture}, "
               f"{plural(engine.model_config.num_layers, 'layer')}), device {cfg.torch_device}, "
               f"{cfg.torch_dtype}, attention {engine.runner.backend.name}, "
               f"graphs {'on' if engine.runner.graphs else 'off'}")
    click.echo(engine.describe_memory())
    if needles:
        describe_needle(needles, input_len, demo)
    elif input_len is not None:
        click.echo(f"prompt: {input_len:,} random token ids per request ({why_random})")
    else:
        click.echo(f"prompt: {prompt}")
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    failed = [o for o in outputs if o.error]
    for o in failed:
        click.echo(f"error: {o.error}", err=True)
    done = [o for o in outputs if not o.error]
    if not done:
        sys.exit(1)
    click.echo("-" * 80)
    text = done[0].text if engine.tokenizer is not None else str(done[0].token_ids)
    click.echo(text)
    click.echo("-" * 80)
    if needles:
        found = [n.secret in o.text for n, o in zip(needles, outputs, strict=True)]
        if len(needles) == 1:
            click.echo(f"needle: the answer {'found' if found[0] else 'did NOT find'} the "
                       f"secret number {needles[0].secret}")
        else:
            click.echo(f"needle: the answers found the secret number in {sum(found)} of "
                       f"{len(needles)} requests")
    n_in = sum(len(o.prompt_token_ids) for o in done)
    n_out = sum(len(o.token_ids) for o in done)
    ttft = max(o.ttft_s for o in done)
    tpots = [o.tpot_s for o in done if o.tpot_s is not None]
    tpot = sum(tpots) / len(tpots) if tpots else float("nan")
    decode_s = wall - ttft
    click.echo(f"requests {len(done)}  prompt tokens {n_in}  output tokens {n_out}")
    click.echo(f"TTFT {ttft * 1e3:.1f} ms  prefill {n_in / ttft:,.0f} tok/s")
    click.echo(f"TPOT {tpot * 1e3:.2f} ms  decode {(n_out - len(done)) / decode_s:,.1f} tok/s")
    streamer = engine.kv.streamer
    if streamer is not None and n_out > len(done):
        share = engine.runner.cpu_share
        click.echo(describe_streamed(engine.kv, streamer.bytes_loaded,
                                     cfg.tensor_parallel_size,
                                     share.tokens if share is not None else 0))
    sys.exit(1 if failed else 0)


def check_lengths(input_len: int | None, output_len: int, limit: int, what: str) -> None:
    """Usage errors for prompt and output lengths that cannot fit `limit` tokens together."""
    if output_len >= limit:
        raise click.UsageError(f"--output-len {output_len} does not fit {what}: prompt and "
                               f"output share it, so the output can be at most {limit - 1} "
                               f"tokens")
    if input_len is not None and input_len + output_len > limit:
        raise click.UsageError(f"--input-len {input_len} + --output-len {output_len} = "
                               f"{input_len + output_len} tokens do not fit {what}")


def describe_streamed(kv: KVManager, nbytes: int, tp: int, cpu_tokens: int = 0) -> str:
    """What the run's last decode step streamed host->device (a rank's share under TP), and
    what the CPU attended beside it (cpu_attention)."""
    plan = kv.plan
    pages = nbytes // (plan.streamed_layers * plan.layer_page_bytes)
    rank = " per GPU" if tp > 1 else ""
    cpu = (f"; the CPU attended {plural(cpu_tokens // kv.spec.page_size, 'page')} of each "
           f"streamed layer from host memory" if cpu_tokens else "")
    return (f"offload: {plan.resident_layers} of {plural(plan.num_layers, 'layer')} resident, "
            f"{plan.streamed_layers} streamed; the last decode step streamed "
            f"{format_bytes(nbytes)} host->device{rank} ({plural(pages, 'page')} of each "
            f"streamed layer){cpu}")


def describe_needle(needles: list, input_len: int, demo: bool) -> None:
    from nanoserve.needle import NEEDLE, QUESTION

    n = needles[0]
    origin = " (the default demo; --prompt TEXT or --input-len N for your own)" if demo else ""
    which = f"request 1 of {len(needles)}: " if len(needles) > 1 else ""
    click.echo(f"prompt: a {input_len:,}-token needle-in-a-haystack prompt{origin}")
    click.echo(f"  {which}filler sentences hide \"{NEEDLE.format(secret=n.secret)}\" at depth "
               f"{n.depth:.2f} (token {n.needle_start:,}), then the question:")
    click.echo(f"  {QUESTION}")


@main.command()
@engine_options()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--served-model-name", default=None,
              help="Model name clients send [default: --model, or the embedded model's name].")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256,
              show_default=True,
              help="Output cap for chat requests that give no max_tokens.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--api-key", envvar="NANOSERVE_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every route but /health and "
                   "/metrics.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=None,
              help="Largest request body, else 413 [default: max(1 MiB, 64 x max_model_len)].")
@click.option("--max-waiting-requests", type=click.IntRange(min=0), default=1024,
              show_default=True,
              help="Sequences that may wait beyond --max-num-seqs; more get 503 with "
                   "Retry-After.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True, max=3600),
              default=30.0, show_default=True,
              help="Seconds a client has to send its request body, else 408.")
@click.option("--timeout-keep-alive", type=click.IntRange(min=1), default=5, show_default=True,
              help="Seconds an idle keep-alive connection stays open.")
@click.option("--allowed-hosts", default=None,
              help="Comma-separated Host header names the server answers to ('*': any; "
                   "'*.example.com': its subdomains); other hosts get 400, so a web page that "
                   "rebinds its DNS name to this machine cannot drive it [default: loopback "
                   "names when --host is a loopback address, else any].")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True, max=3600),
              default=10.0, show_default=True,
              help="Seconds a connection has to send a whole request head (from its opening "
                   "or its previous response), else it is closed.")
@click.option("--max-connections", type=click.IntRange(min=1), default=2048,
              show_default=True, help="Open connections; more get 503 and are closed.")
@click.option("--tool-call-parser", type=click.Choice(["hermes", "llama3_json"]), default=None,
              help="How answers are read for tool calls [default: the model family's: hermes "
                   "for Qwen, llama3_json for Llama].")
@click.option("--reasoning-parser", type=click.Choice(["qwen3"]), default=None,
              help="Split <think>...</think> off into reasoning_content [default: off].")
def serve(host, port, served_model_name, default_max_tokens, log_level, api_key,
          max_body_bytes, max_waiting_requests, body_timeout, timeout_keep_alive, allowed_hosts,
          header_timeout, max_connections, tool_call_parser, reasoning_parser, **kw) -> None:
    """OpenAI-compatible HTTP server (completions, chat completions, streaming)."""
    try:
        from nanoserve.serve.app import build_app
        from nanoserve.serve.async_engine import AsyncEngine
        from nanoserve.serve.middleware import allowed_hosts_for
        from nanoserve.serve.server import run_server
    except ImportError as e:
        raise click.UsageError(f"serve needs the server extra: pip install 'nanoserve[serve]' "
                               f"({e})") from e
    from nanoserve.llm import LLM

    try:
        hosts = allowed_hosts_for(host, allowed_hosts)
        cfg = build_config(kw)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        llm = LLM.from_config(cfg)
    except (ValueError, OSError, KeyError, TensorParallelFailure) as e:
        fail(e)
    engine = llm.engine
    name = served_model_name or kw["model"] or engine.model_dir.name
    click.echo(f"model {engine.model_dir} served as {name!r}, max_model_len "
               f"{engine.max_model_len}, device {cfg.torch_device}, graphs "
               f"{'on' if engine.runner.graphs else 'off'}")
    click.echo(engine.describe_memory())
    app = build_app(AsyncEngine(engine), name, default_max_tokens, api_key=api_key or None,
                    max_body_bytes=max_body_bytes, max_waiting_requests=max_waiting_requests,
                    body_timeout_s=body_timeout, allowed_hosts=hosts,
                    tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    if api_key:
        click.echo("API key required on every route but /health and /metrics")
    click.echo(f"answers Host {', '.join(hosts) if hosts else 'any'}; request heads within "
               f"{header_timeout:g} s; at most {max_connections} connections")
    run_server(app, host, port, log_level, timeout_keep_alive=timeout_keep_alive,
               header_timeout_s=header_timeout, max_connections=max_connections)
    click.echo("nanoserve: shut down cleanly")


if __name__ == "__main__":
    main()
