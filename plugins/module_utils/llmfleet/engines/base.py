"""What an engine profile is: one frozen record of everything engine-specific (the engines/ modules fill one
each; the rest of the package asks it instead of naming an engine). Stdlib only, Python >= 3.8."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class StartRule(NamedTuple):
    """A slow path an engine reports in its start-up log (llmfleet.engine.startscan): the engine's own format string
    as a pattern, what it means, what it costs and the fix; `place` orders a report by topic across engines."""

    id: str
    engine: str  # the engine whose line it is, or "any"
    pattern: Any  # re.Pattern
    what: str
    cost: str
    fix: str
    severity: str = "warning"
    place: int = 0


MOE_COST = (
    "the fused-MoE kernel runs with a generic tile config instead of one tuned for this GPU and shape; measured "
    "elsewhere: from no end-to-end change (vLLM PR 52192, +3.5 % kernel geomean) to 1.37-1.74x kernel time and "
    "+23 % end-to-end prefill throughput (SGLang #32806, H200) and up to 1.93x kernel time (vLLM PR 54500, "
    "H20 FP8); this tool does not measure it on your GPU"
)


class ProfileError(ValueError):
    """A deployment a profile cannot render; the message names the variable and the fix (the plan raises it as
    llmfleet.engine.command.PlanError)."""


@dataclass(frozen=True)
class Router:
    """A router the profile runs in front of its instances (vllm_pd: vllm-router on the head)."""

    command: tuple[str, ...]
    help_args: tuple[str, ...]
    # The line the router logs once it can route (the wrapper's READY), and how often it checks its workers.
    ready_re: str
    check_interval: int
    # The wrapper's options that hand it the API key (the unit's api-key credential), names only.
    secret_args: tuple[str, ...]
    # Its argv from the role's router spec (command, host, port, instances, startup_timeout, extra_args).
    render: Callable[[Mapping[str, Any]], list] | None = None


@dataclass(frozen=True)
class Profile:
    """One engine_profile. `engine` is the engine package behind it ('' for custom: an unknown command, nothing
    to check against); profiles of one engine share its flag tables and log phrases."""

    name: str
    engine: str
    label: str  # how messages name the engine
    default_port: int
    command: tuple[str, ...] = ()  # engine_command when the inventory gives none
    help_args: tuple[str, ...] = ("--help",)
    loader_threads: int = 1  # loader threads per rank when the deployment does not say
    # The head's last start-up line (the API serves); a worker node's, per mode ("graphs" / "eager"), and
    # whether a worker logs it once per local rank (else once per node).
    serving_re: str = ""
    # The start-up phases the engine logs on the way (llmfleet.engine.logobserver's names: dist_init, dist_ready,
    # loading, loaded, warmup, warm; serving is serving_re): one pattern each.
    phases: Mapping[str, str] = field(default_factory=dict)
    node_up_re: Mapping[str, str] = field(default_factory=dict)
    node_up_per_rank: bool = False
    no_graph_flag: str = ""  # the flag that turns CUDA graphs off (a worker then waits for the eager line)
    # The engine's own argv from the parts every engine shares (llmfleet.engine.command.render_argv: command,
    # model, tp, pp, nnodes, node_rank, loader, extra, listen) and the deployment's spec; None: the operator's
    # engine_custom_argv as given.
    render: Callable[[Mapping[str, Any], Mapping[str, Any]], list] | None = None
    # The engine's own NUMA placement flags (any of them in engine_extra_args: the operator's placement wins), the
    # flags that bind (the NUMA node of each GPU follows), and whether it takes one node per local rank only.
    numa_flags: tuple[str, ...] = ()
    numa_bind: tuple[str, ...] = ()
    numa_per_rank: bool = False
    # Every flag llmfleet may write for engine_speculative.
    spec_flags: tuple[str, ...] = ()
    # The fit check: the knobs a fix turns, the memory flags read back from argv, the engine's start-up breakdown.
    fit_flags: Mapping[str, str] = field(default_factory=dict)
    fit_breakdown: tuple[tuple[Any, Callable[[Any], dict]], ...] = ()  # (pattern, the figures of a match)
    rank_re: Any = None  # the rank a start-up line is from (the fit breakdown's per-rank figures)
    # How the engine reads argv (llmfleet.engine.helpflags): "flexible" (vLLM's FlexibleArgumentParser: underscores,
    # dotted keys, -O), "argparse" (plain argparse, allow_abbrev on) or "exact" (option strings as the help lists them).
    argv_reader: str = "exact"
    # Flags a front-end takes before the help-printing parser sees argv (not in the --help text).
    help_extra_flags: Mapping[str, bool] = field(default_factory=dict)
    # The serving benchmark (bench/serve.py): its argv, the file type its results are written in.
    bench_tool: tuple[str, ...] = ()
    bench_result_ext: str = "json"
    # Where the role finds the bench tool: beside the engine's command ("command") or run by its Python ("python").
    bench_tool_from: str = ""
    # Acceptance: the flags that make the engine parse tool calls (PARSER: the model's parser).
    tool_parser_flags: str = ""
    # The wrapper's options that hand the engine the API key (the unit's api-key credential), names only.
    secret_args: tuple[str, ...] = ()
    registry: str = ""  # the model registry file stem (engine/data/registries/<registry>-<version>.json)
    # vllm_pd: every node is an instance of its own (rank 0, no link, each serves the API), a router in front.
    separate_instances: bool = False
    router: Router | None = None
    api_known: bool = True  # the OpenAI API and its /health are known (custom: no probe, no open-API check)
    listens_everywhere: bool = False  # with no engine_host the engine binds every address
    metrics: str = ""  # what its own /metrics is (the report's scrape targets); '' = none known
    # The engine's own compile-cache root (variable -> subdirectory of the fingerprint's cache directory).
    cache_env: Mapping[str, str] = field(default_factory=dict)
    precompile: bool = False
    # The engine's own "fell back" lines in a start-up log (llmfleet.engine.startscan).
    start_rules: tuple[StartRule, ...] = ()  # engine_deepgemm_precompile applies (SGLang's DeepGEMM JIT)

    @property
    def fit_argv_flags(self) -> tuple[str, ...]:
        """The sizing flags read back from argv, in (max_model_len, max_seqs, mem_fraction, kv_cache_dtype) order: the
        fit knobs' own flags (a knob with a value, `--kv-cache-dtype fp8`, by its flag)."""
        f = self.fit_flags
        return tuple(f[k].split()[0] for k in ("max_len", "seqs", "fraction", "kv_fp8")) if f else ()

    def as_dict(self) -> dict[str, Any]:
        """The profile as plain data for Ansible (compiled patterns and functions left out)."""
        out = {}
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            if k in ("fit_breakdown", "rank_re", "render", "start_rules"):
                continue
            if isinstance(v, Router):
                v = {f: list(getattr(v, f)) if isinstance(getattr(v, f), tuple) else getattr(v, f)
                     for f in v.__dataclass_fields__ if f != "render"}  # fmt: skip
            out[k] = dict(v) if isinstance(v, Mapping) else list(v) if isinstance(v, tuple) else v
        return out
