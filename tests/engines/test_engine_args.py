"""spec.engine.args: vLLM's engine arguments validated without vLLM (shipped schema), and the
tenant allowlist (warmserve.engine_arg_policy).

The same cases run against vLLM's real parser in test_vllm_schema.py (vllm group)."""

from __future__ import annotations

import pytest
from warmserve_operator.engine import parse_engine, ttft_report

from warmserve.api.crd import SpecError
from warmserve.engine_arg_policy import CODE, TENANT, WIDENABLE, EngineArgPolicyError
from warmserve.engine_args import (
    DEFAULT_POLICY,
    MANAGED,
    EngineArgPolicy,
    EngineArgsError,
    load_schema,
    parse_engine_args,
    validate_engine_args,
)

# (args, dest -> value) that vLLM accepts
GOOD = [
    (["--max-model-len", "256"], {"max_model_len": 256}),
    (["--max-model-len=256"], {"max_model_len": 256}),
    (["--max_model_len", "2k"], {"max_model_len": "2k"}),
    (["--enforce-eager"], {"enforce_eager": True}),
    (["--no-enforce-eager"], {"enforce_eager": False}),
    (["--dtype", "float32"], {"dtype": "float32"}),
    (["--max-num-seqs", "4", "--enable-prefix-caching"], {"max_num_seqs": 4}),
    (["--compilation-config", '{"mode": 0}'], {}),
    (["--seed", "-1"], {"seed": -1}),
    # the tenant allowlist: data, not code
    (["--quantization", "awq"], {"quantization": "awq"}),
    (["-q", "fp8"], {"quantization": "fp8"}),
    (["--kv-cache-dtype", "fp8", "--block-size", "16"], {"kv_cache_dtype": "fp8"}),
    (["--max-num-batched-tokens", "2k", "--enable-chunked-prefill"], {}),
    (["--max-logprobs", "5", "--seed", "7"], {"max_logprobs": 5}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--compilation-config.mode", "3"], {"compilation_config": {"mode": 3}}),
    (["-cc.cudagraph_mode=PIECEWISE"], {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}),
    (["--compilation-config", '{"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}'], {}),
    (["--override-generation-config", '{"temperature": 0.5, "top_p": 0.9}'], {}),
    (["--override-generation-config.temperature", "0.2"], {}),
    (["--generation-config", "vllm"], {"generation_config": "vllm"}),
    (["--tokenizer-mode", "mistral"], {"tokenizer_mode": "mistral"}),
]
# (args, the argument the error must name)
BAD = [
    (["--max-model-lenn", "256"], "--max-model-lenn"),
    (["--max-model-len", "lots"], "--max-model-len"),
    (["--dtype", "float8"], "--dtype"),
    (["--enforce-eager=maybe"], "--enforce-eager"),
    (["--enforce-eager=true"], "--enforce-eager"),
    (["--max-model-len"], "--max-model-len"),
    (["256"], "256"),
    (["--model", "other"], "--model"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--load-format", "safetensors"], "--load-format"),
    (["--device-ids", "0,1"], "--device-ids"),
    (["--otlp-traces-endpoint", "http://attacker:4317"], "--otlp-traces-endpoint"),
]
# (args, the argument the error must name): valid for vLLM, refused for tenants (the finding's
# flags and their kin: code, class/module/plugin names, paths, network endpoints, hub fetches)
REFUSED = [
    (["--trust-remote-code"], "--trust-remote-code"),
    (["--tokenizer", "attacker/repo"], "--tokenizer"),
    (["--worker-extension-cls", "evil.Ext"], "--worker-extension-cls"),
    (["--logits-processors", "evil.LP"], "--logits-processors"),
    (["--speculative-config", '{"method": "custom_class"}'], "--speculative-config"),
    (["-sc.model", "attacker/draft"], "-sc.model"),
    (["--kv-transfer-config", '{"kv_connector_module_path": "evil"}'], "--kv-transfer-config"),
    (["--reasoning-parser-plugin", "/tmp/evil.py"], "--reasoning-parser-plugin"),
    (["--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://attacker:5557"}'],
     "--kv-events-config"),
    (["--allowed-local-media-path", "/"], "--allowed-local-media-path"),
    (["--revision", "main"], "--revision"),
    (["--code-revision", "main"], "--code-revision"),
    (["--hf-config-path", "attacker/config"], "--hf-config-path"),
    (["--scheduler-cls", "evil.Sched"], "--scheduler-cls"),
    (["--model-class-overrides", '{"LlamaForCausalLM": "evil:C"}'], "--model-class-overrides"),
    (["--logging-config.pylogging_config_file=/l.json"], "--logging-config.pylogging_config_file"),
    (["--enable-prompt-embeds"], "--enable-prompt-embeds"),
    # allowed dests, refused values or keys
    (["--quantization", "my_plugin_quant"], "--quantization"),
    (["--generation-config", "/etc"], "--generation-config"),
    (["--tokenizer-mode", "custom"], "--tokenizer-mode"),
    (["--compilation-config", '{"backend": "evil.fn"}'], "--compilation-config"),
    (["--compilation-config.backend", "evil.fn"], "--compilation-config.backend"),
    (["-cc.inductor_compile_config", '{"x": 1}'], "-cc.inductor_compile_config"),
    (["-cc.pass_config.fuse_norm_quant", "true"], "-cc.pass_config.fuse_norm_quant"),
    (["--compilation-config.custom_ops+", "all"], "--compilation-config.custom_ops+"),
    (["--override-generation-config", '{"logits_processors": 1}'], "--override-generation-config"),
]  # fmt: skip
# The reviewer's flags in every form vLLM's parser takes: each is refused, naming the flag.
FINDING = ["--trust-remote-code", "--tokenizer", "--worker-extension-cls", "--logits-processors",
           "--speculative-config", "--kv-transfer-config", "--reasoning-parser-plugin",
           "--kv-events-config", "--allowed-local-media-path"]  # fmt: skip


def _forms(flag: str) -> list[tuple[list[str], str]]:
    opt = load_schema().by_flag[flag]
    under = "--" + flag[2:].replace("-", "_")
    if not opt.takes_value:
        forms = [([flag], flag), ([under], under), (["--no-" + flag[2:]], "--no-" + flag[2:])]
        return [*forms, ([f"{flag}=true"], flag)]
    forms = [([flag, "x/y"], flag), ([f"{flag}=x/y"], flag), ([under, "x/y"], under)]
    forms.append(([f"{under}=x/y"], under))
    if opt.kind in ("json", "str"):  # --json-arg.key value
        forms += [([f"{flag}.model", "x/y"], f"{flag}.model"), ([f"{flag}.a.b=1"], f"{flag}.a.b")]
    return forms


FORMS = [f for flag in FINDING for f in _forms(flag)]


def test_schema_is_vllms() -> None:
    s = load_schema()
    assert s.vllm_version and len(s.options) > 100
    assert "--max-model-len" in s.by_flag and "--no-enforce-eager" in s.by_flag


@pytest.mark.parametrize(("args", "want"), GOOD)
def test_good_args_parse(args: list[str], want: dict) -> None:
    got = parse_engine_args(args)
    for k, v in want.items():
        assert got[k] == v


@pytest.mark.parametrize(("args", "name"), BAD)
def test_bad_args_are_refused_naming_the_argument(args: list[str], name: str) -> None:
    with pytest.raises(EngineArgsError) as e:
        validate_engine_args(args)
    assert e.value.arg == name
    assert name in str(e.value)


@pytest.mark.parametrize(("args", "name"), REFUSED + FORMS)
def test_tenants_cannot_set_what_runs_code_or_reaches_out(args: list[str], name: str) -> None:
    with pytest.raises(EngineArgsError) as e:
        validate_engine_args(args)
    assert e.value.arg == name
    assert f"spec.engine.args: {name}: " in str(e.value)
    assert "not allowed for tenants" in str(e.value)


@pytest.mark.parametrize(("args", "name"), _forms("--otlp-traces-endpoint"))
def test_the_engines_trace_endpoint_is_warmserves_in_every_form(args: list[str], name: str) -> None:
    """The agent starts engines with its own --otlp-traces-endpoint (the chart's
    tracing.endpoint); a tenant's would send every request's trace where it likes.  Refused
    under the tenant allowlist, the widest admin policy and after the policy (the agent)."""
    widest = EngineArgPolicy.from_admin(sorted(WIDENABLE), sorted(CODE))
    for policy in (DEFAULT_POLICY, widest, None):
        with pytest.raises(EngineArgsError) as e:
            parse_engine_args(args, policy=policy)
        assert e.value.arg == name
        assert "set by warmserve: traces go where the agent's" in str(e.value)


def test_refusals_say_why_and_how_the_admin_widens() -> None:
    def why(args: list[str]) -> str:
        with pytest.raises(EngineArgsError) as e:
            validate_engine_args(args)
        return str(e.value)

    assert "runs the Python code of the model's repository" in why(["--trust-remote-code"])
    msg = why(["--kv-events-config", '{"endpoint": "tcp://x:5557"}'])
    assert "network endpoint" in msg and "--allow-engine-arg kv_events_config" in msg
    assert "engineArgs.extraAllowed" in msg
    assert "fetch" in why(["--tokenizer", "x/y"])
    assert "set by warmserve: the model is spec.model.name" in why(["--model", "x"])
    assert "allowed keys: cudagraph_capture_sizes, cudagraph_mode" in why(["-cc.backend", "x"])
    assert "awq" in why(["--quantization", "plugin"])  # lists the built-in methods


def test_admin_widening() -> None:
    args = ["--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://collector:5557"}']
    with pytest.raises(EngineArgsError):
        validate_engine_args(args)
    widened = EngineArgPolicy.from_admin(["kv-events-config"], known=load_schema().dests)
    validate_engine_args(args, widened)
    with pytest.raises(EngineArgsError, match="--trust-remote-code"):
        validate_engine_args(["--trust-remote-code"], widened)
    # what can run code: only under its own, loudly named setting
    with pytest.raises(EngineArgPolicyError, match="--unsafe-allow-code-engine-arg"):
        EngineArgPolicy.from_admin(["trust_remote_code"])
    with pytest.raises(EngineArgPolicyError, match="set by warmserve"):
        EngineArgPolicy.from_admin([], ["load_format"])
    with pytest.raises(EngineArgPolicyError, match="tenants may set it already, within a rule"):
        EngineArgPolicy.from_admin(["compilation_config"])
    validate_engine_args(["--max-model-len", "8"], EngineArgPolicy.from_admin(["max_model_len"]))
    with pytest.raises(EngineArgPolicyError, match="not a vLLM engine argument"):
        EngineArgPolicy.from_admin(["no_such"], known=load_schema().dests)
    unsafe = EngineArgPolicy.from_admin([], ["trust_remote_code", "compilation_config"])
    validate_engine_args(["--trust-remote-code", "-cc.backend", "my.backend"], unsafe)
    with pytest.raises(EngineArgsError, match="--model"):
        validate_engine_args(["--model", "x"], unsafe)


def test_every_vllm_argument_is_classified() -> None:
    """Regenerating the schema for a new vLLM fails here until each new dest is classified."""
    dests = load_schema().dests
    tables = {"TENANT": TENANT, "MANAGED": MANAGED, "CODE": CODE, "WIDENABLE": WIDENABLE}
    seen: dict[str, str] = {}
    for name, table in tables.items():
        for d in table:
            assert d not in seen, f"{d} is in {seen.get(d)} and {name}"
            seen[d] = name
    assert sorted(dests - set(seen)) == [], "classify these in warmserve/engine_arg_policy.py"
    assert sorted(set(seen) - dests) == [], "not in vLLM's schema any more"
    assert len(load_schema().quantization_methods) > 10


def test_an_unclassified_dest_counts_as_code() -> None:
    allowed, _, why = DEFAULT_POLICY.rule("some_future_arg")
    assert not allowed and "can run code" in why
    with pytest.raises(EngineArgPolicyError, match="unsafe"):
        EngineArgPolicy.from_admin(["some_future_arg"])


def test_values_never_start_like_an_option() -> None:
    """vLLM's parser reads a value such as "-q" or "--config" as an option (and "--config"
    makes it read a YAML file), so it is refused where vLLM would read it so."""
    for args in (["--max-model-len", "-q"], ["--tokenizer-mode=--config"], ["--seed", "-1.5"]):
        with pytest.raises(EngineArgsError):
            parse_engine_args(args)
    assert parse_engine_args(["--seed", "-3"]) == {"seed": -3}


def test_operator_refuses_at_admission_naming_the_argument() -> None:
    with pytest.raises(SpecError, match="--max-model-lenn"):
        parse_engine({"engine": {"args": ["--max-model-lenn", "4"]}})
    with pytest.raises(SpecError, match=r"spec\.engine\.name"):
        parse_engine({"engine": {"name": "tgi"}})
    assert parse_engine({"engine": {"name": "vllm", "args": ["--enforce-eager"]}}) == (
        "vllm",
        ("--enforce-eager",),
    )
    assert parse_engine({}) == ("", ())
    # admission applies the allowlist; readers (gateway, finalizer) check the schema only
    trc = {"engine": {"args": ["--trust-remote-code"]}}
    with pytest.raises(SpecError, match="--trust-remote-code: not allowed for tenants"):
        parse_engine(trc, DEFAULT_POLICY)
    assert parse_engine(trc) == ("", ("--trust-remote-code",))
    with pytest.raises(SpecError, match="set by warmserve"):
        parse_engine({"engine": {"args": ["--load-format", "auto"]}})


def test_ttft_report() -> None:
    status, cond = ttft_report([], 1.0)
    assert cond[1] is None and status["samples"] == 0
    status, cond = ttft_report([(0.2, 10, 300.0), (0.0, 0, 300.0)], 1.0)
    assert cond[1] is True and status["observedP95Seconds"] == 0.2
    status, (_, met, reason, message) = ttft_report([(0.2, 10, 300.0), (1.5, 3, 300.0)], 1.0)
    assert met is False and reason == "ObjectiveMissed"
    assert status["samples"] == 13 and status["observedP95Seconds"] == 1.5
    assert "exceeds the objective 1s" in message


def test_engine_names_match_the_agent_registry() -> None:
    from warmserve_agent.engines import ENGINES

    from warmserve.api.crd import ENGINE_NAMES

    assert set(ENGINE_NAMES) == set(ENGINES)
