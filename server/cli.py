"""`engine-serve`: the OpenAI / Anthropic / Responses server on one model or several.

Several models: `--model A --model B` or `--models-dir DIR`, picked by the request's
`model` (server/models_cli.py, docs/models-serving.md).

    engine-serve [--model DIR] [--host 127.0.0.1] [--port 8090] [--memory-budget GB]
                 [--prompt-cache GiB] [--kv-quant config|off|4|8] [--thinking true|false]
                 [--temperature T] [--top-p P] [--top-k K] [--max-tokens N]
                 [--adapter DIR] [--api-key KEY] [--batch N] [--adapter-dir DIR ...]
                 [--cors-origins ORIGIN ...] [--max-body-mb MB] [--max-prompt-chars N]
                 [--tensor-parallel [--tp-timeout S]]   (under mlx.launch: docs/distributed.md)

Without --model it serves the built-in default model (a tiny model built
offline into the fixture cache; nothing is downloaded). mlx_lm.server flags
are accepted as aliases (--temp, --adapter-path, --decode-concurrency,
--prompt-cache-bytes, --kv-bits, --chat-template, --chat-template-args, ...), so it is a
drop-in. When it listens it prints a ready line (URL, model id, admission ceiling, auth),
then the SDK base URL, the chat page, /metrics and a copy-paste curl.
The security flags and their defaults are described in docs/security.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from engine import CliParser, add_speculation_flags, json_dict as _json_dict, parse_bool as _bool
from engine import add_deterministic_flag, default_draft_tier, speculation_settings

from .listen import BackgroundServer, bind, uvicorn_server, url_of  # noqa: F401  (re-exported)
from .security import is_loopback

NOT_YET = "continuous batching is not available"


def parser() -> argparse.ArgumentParser:
    p = CliParser(prog="engine-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", action="append", default=None,
      help="model directory or Hugging Face repo id (default: the built-in tiny model, random "
      "weights); repeat it (or add --models-dir) to serve several, picked by the request's "
      "`model` (docs/models-serving.md)")
    a("--model-id", help="the id echoed back as `model` (default: the directory name)")
    a("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    a("--port", type=int, default=8090, help="port (default 8090; 0 = any free port)")
    a("--memory-budget", type=float, metavar="GB",
      help="admission budget in decimal GB (x1e9); default: machine RAM x 0.75")
    a("--prompt-cache", type=float, metavar="GiB",
      help="prompt (prefix KV) cache cap in binary GiB (x2^30); 0 disables; default: a "
      "quarter of the memory budget left after the weights")
    a("--prompt-cache-dir", metavar="DIR",
      help="also keep prefixes' KV as files in DIR (mlx-lm's prompt-cache format), read "
      "back after a restart")
    a("--prompt-cache-disk-gb", type=float, default=20.0, metavar="GB",
      help="cap of --prompt-cache-dir in decimal GB (default 20); least recently used "
      "files are deleted first")
    a("--prompt-cache-bytes", type=int, help="(mlx_lm.server) prompt cache cap in bytes")
    a("--prompt-cache-size", type=int, help="(mlx_lm.server) entry count: accepted, ignored "
      "(the cache is byte-capped)")
    a("--kv-quant", default=None, metavar="config|off|4|8",
      help="KV quantization: per-layer kv_config.json from the model dir (default), off, or "
      "uniform bits (group 64, or 32 when head_dim needs it)")
    a("--kv-bits", type=int, help="(mlx_lm.server) = --kv-quant BITS")
    a("--kv-group-size", type=int, choices=[32, 64, 128], help="group size for --kv-quant BITS")
    a("--thinking", type=_bool, metavar="true|false",
      help="server default for the template's enable_thinking")
    a("--temp", "--temperature", dest="temperature", type=float,
      help="default temperature (request > this > generation_config.json > greedy)")
    a("--top-p", type=float, help="default top-p")
    a("--top-k", type=int, help="default top-k")
    a("--min-p", type=float, help="default min-p")
    a("--max-tokens", type=int, default=None, help="default max tokens of a request that sets "
      "none (default: no cap: the model's context left, bounded by memory admission)")
    a("--adapter-path", "--adapter", dest="adapter", metavar="DIR",
      help="LoRA adapter (mlx-lm format) mounted at start; the default for requests")
    a("--api-key", help="require Authorization: Bearer KEY or x-api-key on every route but "
      "/health")
    a("--batch", "--decode-concurrency", dest="batch", type=int, default=None, metavar="N",
      help="continuous batching of up to N rows (default 32, as mlx_lm.server; memory "
           "admission may hold rows back); 1 = one request at a time, each exactly "
           "mlx_lm.generate's token loop (docs/server.md; with --tier l3, one fast row); "
           "quantized KV and per-request adapters run one at a time beside the batch")
    add_speculation_flags(a)
    a("--draft-tier", choices=("l1", "l3"), default=None,
      help="with --draft-model, where the batch rows' draft steps run: l1 (the draft model's "
           "own forward) or l3 (the fast runner's kernels; answers unchanged: the model "
           "verifies every draft; docs/fast-draft.md); default l3 on CUDA, l1 elsewhere")
    a("--draft-max-rows", type=int, default=None, metavar="N",
      help="with --draft-model, drafting pauses while more than N rows decode (greedy and "
           "exact-scheme rows; default: never; docs/fast-draft.md)")
    add_deterministic_flag(a)
    a("--warm-up", type=_bool, default=True, metavar="BOOL",
      help="with the fast runner (--tier l3): decode throw-away rows at every rows bucket up to "
           "--batch before saying ready, so its kernel builds and traces (on a GPU up to a minute "
           "or more for an 8B model) do not stall the first requests")
    a("--warm-up-tokens", type=int, default=None, metavar="N",
      help="on a GPU, the warm-up also prefills one throw-away prompt of N tokens, so the first "
           "long request does not pay for what a fresh process first needs (default: the "
           "longest prefix --prompt-cache-dir holds, else 0: none)")
    a("--max-queue", type=int, default=None, metavar="N",
      help="requests waiting to start, both lanes, before 503 + Retry-After (default 8 x "
           "--batch, at least 16)")
    a("--prompt-concurrency", type=int, help="(mlx_lm.server) accepted, ignored")
    a("--prefill-step-size", type=int, default=2048, help="prefill chunk size (2048)")
    a("--prefill-budget", type=int, default=None, metavar="N",
      help="prompt tokens one batch step prefills, shared by the prompts prefilling (default: "
           "--prefill-step-size; 0: each prompt a full chunk, mlx-lm's BatchGenerator schedule; "
           "models with sliding windows always use 0)")
    a("--chat-template", metavar="FILE|STRING",
      help="chat template (Jinja) replacing the model's: a file, or the template itself")
    a("--chat-template-args", type=_json_dict, default={}, metavar="JSON",
      help='default chat-template kwargs, e.g. \'{"enable_thinking": false}\'')
    a("--cors-origins", "--allowed-origins", dest="cors_origins", nargs="*", default=[],
      metavar="ORIGIN", help="browser origins granted the API routes (CORS), e.g. "
      "http://localhost:3000, or * for any; default none: requests carrying an Origin "
      "header are refused")
    a("--allow-image-urls", action="store_true",
      help="fetch http(s) image URLs in requests (default: off; data: URLs always work)")
    a("--allow-private-image-urls", action="store_true",
      help="with --allow-image-urls: also from loopback, link-local and private addresses")
    a("--max-image-mb", type=float, default=20.0, help="an image's encoded size cap (20 MiB)")
    a("--image-url-timeout", type=float, default=10.0,
      help="seconds to fetch an image URL (10)")
    a("--cors-admin", action="store_true",
      help="grant the --cors-origins the admin routes too (/v1/adapters, /stats)")
    a("--allowed-hosts", nargs="*", default=None, metavar="HOST",
      help="Host header names answered (default: localhost, 127.0.0.1, ::1 when bound to "
      "loopback; otherwise IP addresses, loopback and this machine's names without --api-key, "
      "any with it; * = any)")
    a("--adapter-dir", action="append", default=None, metavar="DIR",
      help="directory POST /v1/adapters may mount from (repeatable; default "
      "~/.cache/mlx-parity/adapters)")
    a("--max-adapter-mb", type=float, default=1024.0,
      help="largest adapters.safetensors POST /v1/adapters loads, in MiB (1024)")
    a("--max-body-mb", type=float, default=32.0, help="request body limit in MiB (32)")
    a("--max-json-depth", type=int, default=64, help="JSON nesting limit (64)")
    a("--max-json-nodes", type=int, default=0, metavar="N",
      help="JSON values a request body may hold, counted on the raw bytes before parsing "
      "(default 0 = 8 x the model's context length, at least 100000)")
    a("--max-grammar-ms", type=float, default=2000.0, metavar="MS",
      help="a structured-output / forced-tool-call grammar that takes longer to compile is "
      "refused with a 400 (2000)")
    a("--max-schema-nodes", type=int, default=10_000, metavar="N",
      help="JSON nodes a response_format schema (or a forced call's tool schemas) may hold "
      "(10000)")
    a("--max-prompt-chars", type=int, default=0, metavar="N",
      help="characters of text a request may carry, checked before tokenizing (default 0 = "
      "16 x the model's context length)")
    a("--body-timeout", type=float, default=30.0, metavar="S",
      help="a request body must arrive within S seconds (30)")
    a("--header-timeout", type=float, default=10.0, metavar="S",
      help="request line and headers must arrive within S seconds (10)")
    a("--max-header-kb", type=int, default=16, metavar="KB",
      help="request line + headers limit in KiB (16)")
    a("--shutdown-timeout", type=float, default=10.0, metavar="S",
      help="on SIGTERM/SIGINT, queued requests get 503 at once; running ones get S seconds "
      "to finish, then a 503 error (a stream's final error event) (10)")
    a("--stream-interval-ms", type=float, default=25.0, metavar="MS",
      help="coalesce streamed deltas into at most one write per MS while decoding (default "
      "25, as mlx-bun; 0 = a write per token; the first and last tokens are never delayed)")
    a("--embeddings-pooling", choices=["last", "mean"], default=None,
      help="POST /v1/embeddings pooling: last (the last token's hidden state, Qwen3-Embedding "
      "style) or mean (over the input's tokens); default: the checkpoint's "
      "1_Pooling/config.json, else last")
    a("--log-level", default="warning", choices=["debug", "info", "warning", "error",
                                                  "critical", "DEBUG", "INFO", "WARNING",
                                                  "ERROR", "CRITICAL"])
    a("--access-log", action="store_true", help="log every request")
    # mlx_lm.server flags we cannot honour: accepted so scripts start, said out loud
    a("--trust-remote-code", action="store_true", help=argparse.SUPPRESS)
    a("--use-default-chat-template", action="store_true", help=argparse.SUPPRESS)
    a("--pipeline", action="store_true", help=argparse.SUPPRESS)
    a("--quantized-kv-start", type=int, help=argparse.SUPPRESS)
    from engine import add_lever_args  # L3 hook: --tier and the lever switches
    add_lever_args(p)
    from .tp import add_args as add_tp_args     # --tensor-parallel, --tp-timeout
    add_tp_args(p)
    from .models_cli import add_args as add_models_args   # --models-dir, --pin, ...
    add_models_args(p)
    return p


def chat_template_from(value):
    """--chat-template: a file's text, else the string itself; a template that does
    not compile stops the server with its Jinja error."""
    import os

    import jinja2

    from engine import check_chat_template

    if value is None:
        return None
    source = value
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"engine-serve: --chat-template: cannot read {value}: {e}") from None
    try:
        check_chat_template(source)
    except (jinja2.TemplateError, ValueError) as e:
        raise SystemExit(f"engine-serve: --chat-template: not a valid Jinja template: {e}"
                         f"{' (no file of that name either)' if source is value else ''}") \
            from None
    return source


def config_from_args(args):
    from .state import ServerConfig

    if args.prompt_cache is not None:
        if args.prompt_cache < 0:
            raise SystemExit("engine-serve: --prompt-cache must be >= 0")
        cache_bytes = int(args.prompt_cache * (1 << 30))
    elif args.prompt_cache_bytes is not None:
        cache_bytes = max(0, args.prompt_cache_bytes)
    else:
        cache_bytes = None   # a share of the memory budget (ServerState)
    kv = args.kv_quant if args.kv_quant is not None else (
        str(args.kv_bits) if args.kv_bits is not None else "config")
    if not (args.prompt_cache_disk_gb > 0 and math.isfinite(args.prompt_cache_disk_gb)):
        raise SystemExit("engine-serve: --prompt-cache-disk-gb must be a finite number > 0")
    if args.prompt_cache_dir is not None:
        if not args.prompt_cache_dir.strip():
            raise SystemExit("engine-serve: --prompt-cache-dir is empty (give a directory)")
        d = Path(args.prompt_cache_dir).expanduser()
        if d.is_symlink() and not d.exists():
            raise SystemExit(f"engine-serve: --prompt-cache-dir {d} is a broken symbolic link")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"engine-serve: --prompt-cache-dir {d}: {e}") from None
        if not os.access(d, os.W_OK):
            raise SystemExit(f"engine-serve: --prompt-cache-dir {d} is not writable")
        from engine import claim_cache_dir
        try:
            claim_cache_dir(d)          # (before the model loads: one server a directory)
        except OSError as e:
            raise SystemExit(f"engine-serve: --prompt-cache-dir {e}") from None
        if getattr(args, "tensor_parallel", False):
            raise SystemExit("engine-serve: --prompt-cache-dir is not supported with "
                             "--tensor-parallel")
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise SystemExit("engine-serve: --memory-budget must be > 0 (GB)")
    from engine import LeverError, levers_from_args
    try:
        levers = levers_from_args(args)
    except LeverError as e:
        raise SystemExit(f"engine-serve: {e}") from None
    if args.deterministic:
        from engine import why_not_deterministic
        if why_not_deterministic(levers):
            raise SystemExit(f"engine-serve: {why_not_deterministic(levers)}")
    if args.batch is None:   # (admission bounds the rows by memory; unused buckets cost nothing)
        args.batch = 32
    if args.batch < 1:
        raise SystemExit("engine-serve: --batch must be >= 1")
    try:
        # (the batch rows verify on the fast runner with a fast lever: K 4 by default there)
        lookup, draft_tokens = speculation_settings(args, fast=levers.fast_decode)
    except ValueError as e:
        raise SystemExit(f"engine-serve: {e}") from None
    if args.draft_model is not None and getattr(args, "tensor_parallel", False):
        raise SystemExit("engine-serve: --draft-model is not supported with --tensor-parallel")
    if (args.draft_tier is not None or args.draft_max_rows is not None) and args.draft_model is None:
        raise SystemExit("engine-serve: --draft-tier and --draft-max-rows need --draft-model")
    if args.draft_max_rows is not None and args.draft_max_rows < 1:
        raise SystemExit("engine-serve: --draft-max-rows must be >= 1")
    if args.draft_tier is None:
        args.draft_tier = default_draft_tier() if args.draft_model is not None else "l1"
    if args.max_queue is not None and args.max_queue < 0:
        raise SystemExit("engine-serve: --max-queue must be >= 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise SystemExit("engine-serve: --max-tokens must be >= 1")
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("engine-serve: --api-key is empty (an unset variable?); give a key "
                         "or leave the flag out")
    for flag, v in (("--max-body-mb", args.max_body_mb), ("--max-json-depth", args.max_json_depth),
                    ("--body-timeout", args.body_timeout),
                    ("--header-timeout", args.header_timeout),
                    ("--max-header-kb", args.max_header_kb),
                    ("--max-adapter-mb", args.max_adapter_mb),
                    ("--max-grammar-ms", args.max_grammar_ms),
                    ("--max-schema-nodes", args.max_schema_nodes)):
        if not v > 0:
            raise SystemExit(f"engine-serve: {flag} must be > 0")
    if args.warm_up_tokens is not None and args.warm_up_tokens < 0:
        raise SystemExit("engine-serve: --warm-up-tokens must be >= 0")
    if args.max_prompt_chars < 0 or args.shutdown_timeout < 0 or args.max_json_nodes < 0:
        raise SystemExit("engine-serve: --max-prompt-chars, --max-json-nodes and "
                         "--shutdown-timeout must be >= 0")
    from .models_cli import model_values
    models = model_values(args)
    return ServerConfig(
        levers=levers, deterministic=args.deterministic, warm_up=args.warm_up,
        warm_up_tokens=args.warm_up_tokens,
        model=models[0] if len(models) == 1 else None, model_id=args.model_id, host=args.host, port=args.port,
        memory_budget_bytes=int(args.memory_budget * 1e9) if args.memory_budget else None,
        prompt_cache_bytes=cache_bytes, prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_disk_gb=args.prompt_cache_disk_gb, kv_quant=kv, kv_group_size=args.kv_group_size,
        thinking=args.thinking, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, max_tokens=args.max_tokens, adapter=args.adapter,
        prompt_lookup=lookup, num_draft_tokens=draft_tokens, draft_model=args.draft_model,
        spec_sampling=args.spec_sampling, draft_tier=args.draft_tier,
        draft_max_rows=args.draft_max_rows,
        api_key=args.api_key, batch=args.batch, max_queue=args.max_queue,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_grammar_ms=args.max_grammar_ms, max_schema_nodes=args.max_schema_nodes,
        template_kwargs=dict(args.chat_template_args or {}),
        chat_template=chat_template_from(args.chat_template),
        prefill_step_size=args.prefill_step_size,
        prefill_budget=-1 if args.prefill_budget is None else max(0, args.prefill_budget),
        allowed_origins=list(args.cors_origins or []),
        stream_interval_ms=max(0.0, args.stream_interval_ms),
        embeddings_pooling=args.embeddings_pooling,
        allow_image_urls=args.allow_image_urls,
        allow_private_image_urls=args.allow_private_image_urls,
        max_image_bytes=int(args.max_image_mb * (1 << 20)), image_url_timeout=args.image_url_timeout,
        tensor_parallel=bool(getattr(args, "tensor_parallel", False)))


def security_from_args(args, config):
    """The `SecurityConfig` the flags say (see server.security)."""
    from .app import security_for
    from .limits import BodyLimits
    from .security import DEFAULT_ADAPTER_DIR

    hosts = tuple(h.lower().strip("[]") for h in args.allowed_hosts) \
        if args.allowed_hosts is not None else None
    limits = BodyLimits(max_body_bytes=config.max_body_bytes, max_json_depth=args.max_json_depth,
                        max_prompt_chars=args.max_prompt_chars,
                        max_json_nodes=args.max_json_nodes,
                        body_timeout_s=args.body_timeout)
    extra = {} if hosts is None else {"allowed_hosts": hosts}
    return security_for(config, cors_origins=tuple(args.cors_origins or ()),
                        cors_admin=args.cors_admin, limits=limits,
                        adapter_dirs=tuple(args.adapter_dir or (DEFAULT_ADAPTER_DIR,)),
                        max_adapter_bytes=int(args.max_adapter_mb * (1 << 20)),
                        max_header_bytes=args.max_header_kb * 1024, **extra)


def ready_line(state, url: str) -> str:
    adm = state.admission
    budget = (f"{state.config.memory_budget_bytes / 1e9:.2f} GB budget"
              if state.config.memory_budget_bytes else
              f"{adm.budget_bytes / 1e9:.2f} GB budget (RAM x 0.75)")
    extra = f", adapter {'+'.join(state.default_adapters)}" if state.default_adapters else ""
    auth = "on" if state.config.api_key else "off"
    context = (f" of the model's {state.max_position}-token context" if state.max_position
               else "")
    return (f"engine-serve ready: {url} model={state.model_id} "
            f"admission ceiling={state.ceiling} tokens{context} ({budget}; kv {state.kv_mode}"
            f"{extra}) auth={auth}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from .first_run import note_kernel_cache
    note_kernel_cache()     # before loading the model compiles anything
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    config = config_from_args(args)
    security = security_from_args(args, config)
    from . import models_cli
    pool_mode = models_cli.several(args)     # several models (server/models_pool.py)
    why = models_cli.refusal(args, config) if pool_mode else models_cli.pins_without(args)
    if why:
        print(f"engine-serve: {why}", file=sys.stderr)
        return 2
    if config.tensor_parallel:     # ranks > 0 serve nothing: they follow rank 0's steps
        from . import tp
        why = tp.refusal(args, config)
        if why:
            print(f"engine-serve: {why}", file=sys.stderr)
            return 2
        import mlx.core as mx
        if mx.distributed.init().rank() != 0:
            return tp.follow(config, args.tp_timeout)
    if not config.api_key and not is_loopback(config.host):
        print(f"engine-serve: warning: listening on {config.host} without --api-key: anyone "
              "who can reach this address can use the server", file=sys.stderr)
    if args.quantized_kv_start:
        print("engine-serve: --quantized-kv-start is ignored (the server quantizes from "
              "token 0)", file=sys.stderr)
    sock = bind(config.host, config.port)

    from engine import KVConfigError
    from engine import ModelLoadError
    from .app import create_app
    from .first_run import ready_text
    from .state import build_state

    limit = (models_cli.budget_bytes(args, config) if pool_mode
             else config.memory_budget_bytes)
    if limit is not None:
        import mlx.core as mx
        mx.set_memory_limit(int(limit))   # defense in depth
    try:
        if config.tensor_parallel:
            config = tp.agree_config(config)
        state = models_cli.build(args, config) if pool_mode else build_state(config)
    except (ModelLoadError, FileNotFoundError, KVConfigError, ValueError) as e:
        msg = getattr(e, "message", None) or str(e)
        print(f"engine-serve: cannot start: {msg}", file=sys.stderr)
        return 2
    if not pool_mode and config.batch > 1 and not state.engine.batching:
        print(f"engine-serve: --batch {config.batch}: {NOT_YET} with this model's quantized KV "
              "(sliding-window layers: docs/kv-quant.md); serving one request at a time "
              "(/stats batch.batched = false)", file=sys.stderr)
    if not pool_mode and state.ceiling < 1:
        print("engine-serve: cannot start: the model's weights do not fit the memory budget "
              f"({state.admission.budget_bytes / 1e9:.2f} GB)", file=sys.stderr)
        return 2
    app = create_app(state, security)
    server = uvicorn_server(app, args.log_level, args.access_log,
                            header_timeout_s=args.header_timeout,
                            max_header_bytes=args.max_header_kb * 1024,
                            shutdown_timeout_s=args.shutdown_timeout)
    from . import shutdown
    # SIGTERM answers everyone (several models: every resident model's gateway)
    shutdown.install(server, state if pool_mode else state.gateway, args.shutdown_timeout)
    leader = tp.lead(state, args.tp_timeout, app, server) if config.tensor_parallel else None
    url = url_of(sock)

    async def run():
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            line = models_cli.ready_line(state, url) if pool_mode else ready_line(state, url)
            print(ready_text(state, url, line), flush=True)
        await task

    shutdown.exit_through_finally()     # (else uvicorn's re-raised SIGTERM skips the finally)
    try:
        asyncio.run(run())
    except (KeyboardInterrupt, shutdown.Terminated):
        pass
    finally:
        shutdown.second_signal_ends_at_once()     # (while the pending files are finished)
        status = leader.close() if leader is not None else 0   # followers stop too
        if pool_mode:
            state.close()    # every resident model's worker (and its disk cache's flush)
        else:
            state.gateway.close()
            disk = getattr(state.engine, "disk_cache", None)
            if disk is not None:
                disk.flush()     # the last answers' files, for the next start to read
        # MLX tears down the worker thread's stream after Python's join returns;
        # exiting inside that window aborts the process ("terminate called ...")
        time.sleep(0.2)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
