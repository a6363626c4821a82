"""One source for every engine flag (engine/arg_utils.py): each EngineConfig field has exactly one flag with vLLM's
name (or is named in NOT_FLAGS, with why), its help is the docstring under the field, the flags parse back into the
same EngineConfig, a wrong value is refused naming its flag, and no command of the `workbench` CLI declares an engine
flag by hand. Also: the config names the speculative methods without importing engine.spec_decode. No model runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import fields
from typing import get_args

import pytest

from engine.arg_utils import (
    ALIASES,
    ENGINE_FIELDS,
    NOT_FLAGS,
    add_engine_args,
    engine_kwargs_from_args,
    field_help,
    flag_name,
)
from engine.config import EngineConfig, SpeculativeMethod
from workbench import cli

FIELDS = [f.name for f in fields(EngineConfig)]
FLAGGED = [name for name in FIELDS if name not in NOT_FLAGS]


def _parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", exit_on_error=False)
    add_engine_args(parser, **kwargs)
    return parser


def _engine_option_strings() -> dict[str, str]:
    """Every spelling of an engine flag -> its field: vLLM's --x, --no-x for a bool, and the old ALIASES."""
    spellings = {}
    for name in FIELDS:
        for flag in (flag_name(name), "--no-" + flag_name(name)[2:], *ALIASES.get(name, ())):
            spellings[flag] = name
    return spellings


# ---- one flag per field, vLLM's name, help from the field ---------------------------------------------------------
def test_every_field_has_exactly_one_flag_with_vllms_name_or_says_why_not():
    assert set(NOT_FLAGS) <= set(FIELDS) and all(NOT_FLAGS.values())
    actions = [a for a in _parser()._actions if a.option_strings != ["-h", "--help"]]
    assert sorted(a.dest for a in actions) == sorted(FLAGGED)  # one action per field, none twice
    for action in actions:
        main = flag_name(action.dest)
        assert action.option_strings[0] == main
        extra = ["--no-" + main[2:]] if isinstance(action, argparse.BooleanOptionalAction) else []
        assert action.option_strings == [main, *extra, *ALIASES.get(action.dest, ())]


def test_every_field_has_its_help_under_it_in_the_config():
    helps = field_help()
    missing = [name for name in FIELDS if not helps.get(name)]
    assert not missing, f"EngineConfig fields without a docstring under them: {missing}"
    assert set(helps) == set(FIELDS)
    by_dest = {a.dest: a.help for a in _parser()._actions}
    assert by_dest["max_num_batched_tokens"].startswith(helps["max_num_batched_tokens"])


def test_choices_are_the_sets_the_config_checks():
    by_dest = {a.dest: a for a in _parser()._actions}
    for name in (
        "scheduling_policy",
        "executor",
        "prefix_caching_hash_algo",
        "dtype",
        "kv_cache_dtype",
        "data_parallel_routing",
    ):
        value = by_dest[name].choices[0]
        EngineConfig(**{name: value, **({"hardware": "cpu"} if value in ("simulated", "scripted") else {})})
        if name != "executor":  # a scripted executor needs its script, which has no flag
            for choice in by_dest[name].choices:
                EngineConfig(**{name: choice})
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: "no-such-choice"})


# ---- the flags round-trip into EngineConfig ---------------------------------------------------------------------
ROUND_TRIPS = [  # settings that go together; between them, every flag with a value other than its default
    [
        "--model tiny-llama --block-size 8 --num-kv-blocks 64 --kv-cache-memory 1000000 --no-enable-prefix-caching",
        "--kv-cache-dtype bfloat16",
        "--prefix-caching-hash-algo builtin --max-num-batched-tokens 128 --max-num-seqs 4 --max-model-len 256",
        "--no-enable-chunked-prefill --long-prefill-token-threshold 16 --scheduling-policy priority",
        "--no-scheduler-reserve-full-isl --max-logprobs 5 --dtype bfloat16 --device cpu --revision main",
        "--quantization int8 --seed 3 --gpu-memory-utilization 0.5",
        '--speculative-config {"method":"ngram","num_speculative_tokens":2}',
        '--kv-transfer-config {"kv_connector":"shared_storage","kv_role":"kv_both"}',
        '--kv-events-config {"enable_kv_cache_events":true,"replay_endpoint":"tcp://*:5558","topic":"kv"}',
    ],
    [
        "--executor multiproc --tensor-parallel-size 4 --nnodes 2 --master-addr 10.0.0.2 --master-port 29501",
        "--data-parallel-routing prefix --data-parallel-replica-timeout-s 5 --data-parallel-rank 1",
    ],
    ["--data-parallel-size 2 --enable-prefix-caching"],
    ["--executor simulated --hardware h100-sxm --async-scheduling"],
    [
        "--otlp-traces-endpoint http://127.0.0.1:4318/v1/traces --collect-detailed-traces model worker",
        '--profiler-config {"profiler":"torch","torch_profiler_dir":"/tmp/profiles"}',
    ],
]


def _argv(lines: list[str]) -> list[str]:
    return [word for line in lines for word in line.split(" ")]


@pytest.mark.parametrize("lines", ROUND_TRIPS)
def test_parsed_flags_round_trip_into_the_engine_config(lines):
    argv = _argv(lines)
    args = _parser().parse_args(argv)
    config = EngineConfig(**engine_kwargs_from_args(args))
    given = {_engine_option_strings()[word] for word in argv if word.startswith("--")}
    for name in given:
        assert getattr(config, name) == getattr(args, name), name
    assert config.speculative is None or config.speculative.num_speculative_tokens == 2


def test_hardware_is_a_name_or_a_json_object():
    from engine.executor.sim.hardware import hardware_table

    table = {"name": "mine", **hardware_table()["h200"]}
    args = _parser().parse_args(["--executor", "simulated", "--hardware", json.dumps(table)])
    assert args.hardware == table and EngineConfig(**engine_kwargs_from_args(args)).hardware == table


def test_the_round_trips_set_every_flag():
    spellings = _engine_option_strings()
    given = {spellings[word] for lines in ROUND_TRIPS for word in _argv(lines) if word.startswith("--")}
    assert given == set(FLAGGED)


def test_no_flag_given_is_the_engines_defaults():
    assert EngineConfig(**engine_kwargs_from_args(_parser().parse_args([]))).to_dict() == EngineConfig().to_dict()


def test_include_exclude_and_a_commands_defaults():
    parser = _parser(include=["model", "num_kv_blocks", "executor"], exclude=["executor"], defaults={"model": "m"})
    args = parser.parse_args([])
    assert getattr(args, ENGINE_FIELDS) == ("model", "num_kv_blocks")
    assert engine_kwargs_from_args(args) == {"model": "m"}  # None: not given, the engine's default applies
    assert engine_kwargs_from_args(parser.parse_args(["--num-kv-blocks", "9"])) == {"model": "m", "num_kv_blocks": 9}
    with pytest.raises(ValueError, match="no_such_field"):
        _parser(include=["no_such_field"])


def test_an_override_to_none_leaves_a_flag_unset_unless_given():
    args = _parser(include=["executor"], defaults={"executor": None}).parse_args([])
    assert args.executor is None and engine_kwargs_from_args(args) == {}


def test_the_old_spelling_still_turns_prefix_caching_off():
    for argv, on in (([], True), (["--no-prefix-caching"], False), (["--no-enable-prefix-caching"], False)):
        assert _parser().parse_args(argv).enable_prefix_caching is on


def test_two_calls_on_one_parser_add_up():
    parser = _parser(include=["model"])
    add_engine_args(parser, include=["executor"], title="executor")
    assert getattr(parser.parse_args([]), ENGINE_FIELDS) == ("model", "executor")


# ---- a wrong value is refused naming its flag -----------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--block-size", "sixteen"], "--block-size"),
        (["--gpu-memory-utilization", "most"], "--gpu-memory-utilization"),
        (["--scheduling-policy", "lifo"], "--scheduling-policy"),
        (["--dtype", "float64"], "--dtype"),
        (["--speculative-config", "{method: ngram}"], "--speculative-config"),
        (["--kv-transfer-config", "[1, 2]"], "--kv-transfer-config"),
        (["--enable-prefix-caching=yes"], "--enable-prefix-caching"),
        (["--collect-detailed-traces", "gpu"], "--collect-detailed-traces"),
    ],
)
def test_a_wrong_value_is_refused_naming_the_flag(argv, flag):
    with pytest.raises(argparse.ArgumentError) as error:
        _parser().parse_args(argv)
    assert flag in str(error.value)


def test_a_value_the_config_refuses_is_one_line_naming_the_field(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("hello\n")
    argv = ["run", "--prompts", str(tmp_path / "p.txt"), "--trace", str(tmp_path / "t.jsonl"), "--block-size", "12"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == "workbench: error: block_size: must be a power of two >= 1, got 12"


# ---- no command declares an engine flag by hand -----------------------------------------------------------------
# flags spelled as an EngineConfig field that set something else, by command, and what they set
NOT_ENGINE_FLAGS = {
    ("run", "--seed"): "SamplingParams.seed, every prompt's",
    ("train-draft", "--seed"): "the seed of the answers and of the training",
    ("attach", "--block-size"): "the attached vLLM server's block size, checked against its KV events",
    **{
        (cmd, "--seed"): "the workload's seed"
        for cmd in ("tune", "bench all", *(f"bench {b.name}" for b in cli.BENCHMARKS))
    },
    **{
        (cmd, flag_name(knob)): "a search space: the knob's candidates (workbench/bench/tune.py's KNOBS)"
        for cmd in ("tune", "bench tune")
        for knob in ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "block_size")
    },
    **{
        (cmd, flag): "a search space: prefix caching's candidates, on and off (workbench/bench/tune.py's KNOBS)"
        for cmd in ("tune", "bench tune")
        for flag in ("--enable-prefix-caching",)
    },
}


def _commands(parser: argparse.ArgumentParser, path: str = ""):
    """(command path, its parser) for `parser` and every subcommand under it, each one's flags added."""
    parser.format_help()  # a lazy subcommand adds its flags on first use
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{path} {name}".strip())


def test_no_command_declares_an_engine_flag_by_hand():
    spellings = _engine_option_strings()
    seen, by_hand = set(), []
    for path, parser in _commands(cli.build_parser()):
        engine_fields = parser.get_default(ENGINE_FIELDS) or ()
        for action in parser._actions:
            for flag in action.option_strings:
                field = spellings.get(flag)
                if field is None or (path, flag) in NOT_ENGINE_FLAGS:
                    continue
                seen.add(path)
                if not (action.dest == field and field in engine_fields):
                    by_hand.append(f"workbench {path} {flag}")
    assert not by_hand, f"engine flags declared by hand, not by engine.arg_utils.add_engine_args: {by_hand}"
    assert {"run", "serve", "pd", "train-draft", "tune", "bench all", "bench throughput", "bench prefix"} <= seen


def test_the_commands_keep_their_own_defaults():
    parser = cli.build_parser()
    serve = parser.parse_args(["serve"])
    assert (serve.model, serve.num_kv_blocks, serve.enable_prefix_caching) == ("smollm2-135m", 256, True)
    dp = parser.parse_args(["bench", "dp_routing"])
    assert (dp.model, dp.num_kv_blocks, dp.data_parallel_size, dp.block_size) == ("tiny-llama", 56, 2, 16)
    tune = parser.parse_args(["tune", "--executor", "simulated", "--hardware", "h200"])
    assert engine_kwargs_from_args(tune) == {"model": "smollm2-135m", "executor": "simulated", "hardware": "h200"}
    run = parser.parse_args(["run", "--prompts", "p", "--trace", "t", "--seed", "5"])
    assert run.seed == 5 and "seed" not in engine_kwargs_from_args(run)  # the prompts' seed, not the engine's


# ---- the config names the speculative methods; spec_decode registers a proposer for each ------------------------
def test_the_config_does_not_import_spec_decode():
    code = "import sys, engine.config; assert 'engine.spec_decode' not in sys.modules, sorted(sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_every_speculative_method_has_its_proposer():
    from engine.spec_decode import PROPOSERS

    assert list(PROPOSERS) == list(get_args(SpeculativeMethod))


def test_json_flags_take_vllms_spelling():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    args = _parser().parse_args(["--speculative-config", json.dumps(spec)])
    assert EngineConfig(**engine_kwargs_from_args(args)).speculative.prompt_lookup_max == 3
