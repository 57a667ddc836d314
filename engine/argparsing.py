"""The argument parser every CLI of the project uses (engine-generate, engine-serve,
engine-train, engine-convert).

`CliParser` is an `argparse.ArgumentParser` whose errors are one line on stderr and
exit status 2, without the usage block:

- a flag it does not know is named; a near miss gets the closest flag
  (`--max-token is not a flag of engine-generate; did you mean --max-tokens?`);
- a flag of mlx-lm's CLI that this command does not implement says so, with why
  (`CliParser.unsupported`);
- the other argparse errors (missing required flag, bad value) keep argparse's text.

`DefaultsHelpFormatter` shows "(default: X)" after a flag's help unless the help text
already states its default.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re


def parse_bool(v: str) -> bool:
    """argparse type for true|false flags (shared by the project's CLIs)."""
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on", "t"):
        return True
    if s in ("0", "false", "no", "off", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def json_dict(v: str) -> dict:
    """argparse type for a JSON object flag."""
    try:
        d = json.loads(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return d


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" only where the help does not already say its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS, False):
            return text
        return super()._get_help_string(action)


class CliParser(argparse.ArgumentParser):
    """ArgumentParser with one-line errors (exit 2) that name the offending flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._unsupported: dict[str, str] = {}

    def unsupported(self, flags: dict) -> None:
        """Flags (mlx-lm's) this command does not implement: {flag: why}. Using one is an
        error naming it, instead of "unrecognized arguments"."""
        self._unsupported.update(flags)

    def parse_args(self, args=None, namespace=None):
        # A misspelt flag is the error to report, even when a required flag is missing too
        # (argparse would complain about the required one first).
        required = [a for a in self._actions if a.required]
        for a in required:
            a.required = False
        try:
            _, extras = super().parse_known_args(args, None)
        finally:
            for a in required:
                a.required = True
        if extras:
            self.error("unrecognized arguments: " + " ".join(extras))
        return super().parse_args(args, namespace)

    def known_flags(self) -> list[str]:
        return [s for a in self._actions if a.help is not argparse.SUPPRESS
                for s in a.option_strings]

    def unknown_flag_message(self, token: str) -> str:
        flag = token.split("=", 1)[0]
        if flag in self._unsupported:
            return f"{flag} is not supported by {self.prog}: {self._unsupported[flag]}"
        close = difflib.get_close_matches(flag, self.known_flags(), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f" (see {self.prog} --help)"
        return f"{flag} is not a flag of {self.prog}{hint}"

    def error(self, message: str):
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            tokens = m.group(1).split()
            flags = [t for t in tokens if re.match(r"--?[A-Za-z]", t)]
            if flags:
                message = self.unknown_flag_message(flags[0])
            else:
                message = f"unexpected argument {tokens[0]!r} (see {self.prog} --help)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_deterministic_flag(a) -> None:
    """`--deterministic` (engine-generate and engine-serve; `a`: the parser's add_argument)."""
    a("--deterministic", action="store_true",
      help="batch-invariant logits: a request's logprobs and greedy or seeded tokens do not "
      "depend on the other requests in the batch, the prefill chunking or a prompt-cache hit "
      "(CPU, or CUDA for dense full-attention models; --tier l1; docs/deterministic.md)")


def add_speculation_flags(a) -> None:
    """`--draft-model PATH`, `--prompt-lookup N` and `--num-draft-tokens K` (engine-generate
    and engine-serve; `a`: the parser's add_argument). `speculation_settings` checks them."""
    a("--draft-model", metavar="PATH",
      help="speculative decoding with a draft model (a directory or Hugging Face repo id "
      "with the same tokenizer): it drafts K tokens, the model verifies them in one forward "
      "(greedy and sampled requests; docs/generation.md)")
    a("--prompt-lookup", type=int, default=0, metavar="N",
      help="prompt-lookup speculative decoding (greedy requests; in a batch sampled and "
      "constrained ones too): draft the tokens that followed the latest earlier match of the "
      "last N tokens (0: off; docs/generation.md)")
    a("--num-draft-tokens", type=int, default=None, metavar="K",
      help="draft tokens a step: 3 with --draft-model (mlx-lm's); with --prompt-lookup 15 on "
      "CUDA (a verify is padded to 16 positions there anyway), 4 elsewhere")
    a("--spec-sampling", choices=("exact", "rejection"), default="exact",
      help="with --draft-model, how sampled requests keep drafts: exact (mlx-lm's scheme: a "
      "draft kept when the model's own draw equals it; alone, mlx-lm's tokens bit for bit, as "
      "a batch row the tokens it samples without speculation) or rejection (speculative "
      "sampling: the model's distribution, more drafts kept; no XTC, runs alone); greedy is "
      "the same under both (docs/generation.md)")


def lookup_draft_tokens(fast: bool = False) -> int:
    """--prompt-lookup's default K: 15 on CUDA, where a verify's query is padded to 16
    positions anyway (engine/models/bucketed_sdpa.py), so longer drafts cost about what 4 do
    (H100: 2.65x plain at one client vs 1.62x with 4: reports/spec_bench/0.5.6/); 4 elsewhere,
    and 4 for the fast runner's batch rows (`fast`: a verify there costs more the more positions
    it has; 4 is the K measured, 1.18x at one client: reports/spec_bench/0.6.0/)."""
    from engine.models.bucketed_sdpa import on_cuda
    return 15 if on_cuda() and not fast else 4


def default_draft_tier() -> str:
    """engine-serve --draft-tier's default: l3 on CUDA (the draft's steps on the fast runner:
    H100 1.30x plain vs 0.88x on its own forward, reports/spec_bench/0.5.7/), l1 elsewhere
    (on the CPU the fast step's stand-ins are the same ops)."""
    from engine.models.bucketed_sdpa import on_cuda
    return "l3" if on_cuda() else "l1"


def speculation_settings(args, fast: bool = False) -> tuple:
    """(prompt_lookup, num_draft_tokens) from the flags of `add_speculation_flags` (`fast`: the
    rows speculate on the fast runner, `lookup_draft_tokens`); raises ValueError naming the flag
    for values out of range or --draft-model with --prompt-lookup."""
    if args.draft_model is not None and not args.draft_model.strip():
        raise ValueError("--draft-model is empty (give a directory or a repo id)")
    if args.draft_model is not None and args.prompt_lookup:
        raise ValueError("--draft-model and --prompt-lookup are two sources of drafts; "
                         "give one of them")
    if args.num_draft_tokens is not None and args.draft_model is None and not args.prompt_lookup:
        raise ValueError("--num-draft-tokens needs --draft-model or --prompt-lookup")
    if args.spec_sampling != "exact" and args.draft_model is None:
        raise ValueError("--spec-sampling rejection needs --draft-model")
    if not 0 <= args.prompt_lookup <= 64:
        raise ValueError(f"--prompt-lookup must be in [0, 64], got {args.prompt_lookup}")
    k = args.num_draft_tokens
    if k is None:
        k = 3 if args.draft_model is not None else lookup_draft_tokens(fast)
    if not 1 <= k <= 64:
        raise ValueError(f"--num-draft-tokens must be in [1, 64], got {k}")
    return args.prompt_lookup, k
