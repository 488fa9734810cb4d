"""precision auto, the emulated-bf16 rule, memory format and compile: decided from an injected
Hardware, so both CPU kinds (and GPUs) are tested on any machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from fakes import ListReporter
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.cli import main as cli_main
from cascade_ray.errors import HealthError
from cascade_ray.hardware import Hardware
from cascade_ray.solver import build_precision
from cascade_ray.solver.precision import (
    choose_memory_format,
    compile_stage,
    precision_config_issues,
    resolve_precision,
)
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.setup import build_stage_model

CPU = torch.device("cpu")
AVX2, BF16_CPU = Hardware.cpu("AVX2"), Hardware.cpu("AVX512_BF16")
SHORT = ["stages[0].train.max_steps=2", "stages[0].train.epochs=1", "stages[0].train.sanity_val_steps=0"]


def _cfg(*overrides: str):
    return load_config(CONFIGS / "debug.yaml", [*SHORT, *overrides])


def test_auto_is_fp32_on_avx2_and_bf16_with_avx512_bf16_or_amx():
    solver = _cfg().stages[0].solver
    assert solver.precision == "auto"  # the default
    avx2 = build_precision(solver, CPU, "stages[0].solver", hardware=AVX2)
    assert (avx2.name, avx2.dtype, avx2.scaler) == ("fp32", None, None)
    assert avx2.choice.line("features") == "features: precision auto -> fp32 (CPU AVX2: bf16 would be emulated)"
    for hw in (BF16_CPU, Hardware.cpu("AMX")):
        native = build_precision(solver, CPU, "stages[0].solver", hardware=hw)
        assert (native.name, native.dtype) == ("bf16", torch.bfloat16), hw
    plain_avx512 = resolve_precision("auto", Hardware.cpu("AVX512"))  # AVX512 without BF16: oneDNN emulates it
    assert plain_avx512.resolved == "fp32" and "no AVX512-BF16/AMX" in plain_avx512.reason


def test_auto_is_fp16_with_a_scaler_before_ampere_and_bf16_from_ampere():
    solver = _cfg().stages[0].solver
    made = []

    def cpu_scaler(cfg):
        made.append(cfg)
        return torch.amp.GradScaler("cpu", init_scale=cfg.init_scale)

    old = build_precision(solver, torch.device("cuda"), "p", make_scaler=cpu_scaler, hardware=Hardware.cuda(7, 5))
    assert (old.name, old.dtype) == ("fp16", torch.float16) and old.scaler is not None and len(made) == 1
    assert "sm_75: no native bf16, fp16 with a loss scaler" in old.choice.reason
    ampere = build_precision(solver, torch.device("cuda"), "p", hardware=Hardware.cuda(8, 0))
    assert (ampere.name, ampere.scaler) == ("bf16", None)
    # under fsdp a loss scaler would judge each worker's shard alone: auto takes fp32 there, not fp16
    sharded = build_precision(solver, torch.device("cuda"), "p", hardware=Hardware.cuda(7, 5), sharded=True)
    assert (sharded.name, sharded.scaler) == ("fp32", None) and "not sharded under fsdp" in sharded.choice.reason
    sharded_ampere = build_precision(solver, torch.device("cuda"), "p", hardware=Hardware.cuda(8, 0), sharded=True)
    assert sharded_ampere.name == "bf16"


def test_detection_honours_the_avx2_restriction_of_aten_and_onednn():
    """What a user of an AVX2-only CPU sees, reproduced with the kernel-restricting variables."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    code = (
        "import json; from cascade_ray.hardware import detect_hardware; h = detect_hardware('cpu'); "
        "print(json.dumps([h.capability, h.native_bf16, h.bf16_note]))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    capability, native, note = json.loads(out.strip().splitlines()[-1])
    assert capability == "AVX2" and native is False, (capability, note)


def test_the_stage_prints_and_records_what_auto_became(capsys):
    cfg = _cfg()
    outcome = run_stage(cfg, 0, _digits(cfg), None, ListReporter(), CPU, hardware=AVX2)
    out = capsys.readouterr().out
    assert "features: precision auto -> fp32 (CPU AVX2: bf16 would be emulated)" in out
    assert outcome.precision == {
        "requested": "auto",
        "resolved": "fp32",
        "reason": "CPU AVX2: bf16 would be emulated",
        "hardware": "CPU AVX2",
    }
    native = run_stage(cfg, 0, _digits(cfg), None, ListReporter(), CPU, hardware=BF16_CPU)
    assert native.precision["resolved"] == "bf16"


def test_explicit_bf16_on_emulating_cpu_warns_at_validate_time_naming_key_and_slowdown():
    cfg = _cfg("stages[0].solver.precision=bf16", "stages[0].scaling.use_gpu=false")
    errors, warnings = precision_config_issues(cfg, AVX2)
    assert errors == [] and [w.path for w in warnings] == ["stages[0].solver.precision"]
    text = warnings[0].render()
    assert "CPU AVX2 emulates bf16" in text and "8.4x slower than fp32" in text
    assert "policy warn" in text and "precision: auto" in text
    assert precision_config_issues(cfg, BF16_CPU) == ([], [])  # native: nothing to say
    assert precision_config_issues(_cfg("stages[0].scaling.use_gpu=false"), AVX2) == ([], [])  # auto: nothing


def test_emulated_bf16_policy_error_is_a_config_error_and_off_is_quiet():
    bf16 = ["stages[0].solver.precision=bf16", "stages[0].scaling.use_gpu=false"]
    errors, warnings = precision_config_issues(_cfg(*bf16, "stages[0].health.emulated_bf16.policy=error"), AVX2)
    assert warnings == [] and [e.path for e in errors] == ["stages[0].solver.precision"]
    assert precision_config_issues(_cfg(*bf16, "stages[0].health.emulated_bf16.policy=off"), AVX2) == ([], [])


def test_cascade_ray_validate_reports_emulated_bf16(monkeypatch, capsys):
    monkeypatch.setattr("cascade_ray.solver.precision.detect_hardware", lambda device="cpu": AVX2)
    args = [
        "validate",
        str(CONFIGS / "debug.yaml"),
        "stages[0].solver.precision=bf16",
        "stages[0].scaling.use_gpu=false",
    ]
    assert cli_main(args) == 0
    assert "warning: stages[0].solver.precision: stages[0].solver.precision is bf16" in capsys.readouterr().out
    assert cli_main([*args, "stages[0].health.emulated_bf16.policy=error"]) == 2
    assert "stages[0].solver.precision" in capsys.readouterr().err


def test_emulated_bf16_in_the_stage_follows_the_health_policy(capsys):
    bf16 = "stages[0].solver.precision=bf16"
    warned = run_stage(_cfg(bf16), 0, _digits(_cfg()), None, ListReporter(), CPU, hardware=AVX2)
    out = capsys.readouterr().out
    assert "WARNING health:" in out and "stages[0].solver.precision is bf16" in out and warned.health_warnings == 1
    assert warned.precision["resolved"] == "bf16"  # explicit: kept, only warned about
    with pytest.raises(HealthError) as info:
        run_stage(
            _cfg(bf16, "stages[0].health.emulated_bf16.policy=error"),
            0,
            _digits(_cfg()),
            None,
            ListReporter(),
            CPU,
            hardware=AVX2,
        )
    assert "key: stages[0].solver.precision" in str(info.value) and "emulated_bf16" in str(info.value)
    quiet = run_stage(
        _cfg(bf16, "stages[0].health.emulated_bf16.policy=off"),
        0,
        _digits(_cfg()),
        None,
        ListReporter(),
        CPU,
        hardware=AVX2,
    )
    assert "WARNING health:" not in capsys.readouterr().out and quiet.health_warnings == 0


def test_memory_format_follows_the_measured_table_and_the_key():
    cfg = _cfg()
    data = _digits(cfg)
    resnet, _ = build_stage_model(cfg, 0, data, None)
    assert choose_memory_format(cfg.stages[0], AVX2, "fp32", resnet)[0] == "channels_last"
    assert choose_memory_format(cfg.stages[0], Hardware.cuda(8, 0), "bf16", resnet) == (
        "contiguous",
        "not measured for GPU injected GPU sm_80 bf16",
    )
    mlp_cfg = load_config(CONFIGS / "debug.yaml")
    mlp, _ = build_stage_model(mlp_cfg, 2, data, None)
    mlp_only = torch.nn.Sequential(*[m for m in mlp.blocks["classifier"].modules() if isinstance(m, torch.nn.Linear)])
    assert choose_memory_format(mlp_cfg.stages[2], AVX2, "fp32", mlp_only) == ("contiguous", "no 2-D convolutions")
    forced = _cfg("stages[0].memory_format=contiguous").stages[0]
    assert choose_memory_format(forced, AVX2, "fp32", resnet) == ("contiguous", "set explicitly")


def test_channels_last_stage_trains_and_records_it(capsys):
    outcome = run_stage(
        _cfg("stages[0].memory_format=channels_last"), 0, _digits(_cfg()), None, ListReporter(), CPU, hardware=AVX2
    )
    assert outcome.memory_format == "channels_last" and outcome.steps == 2
    assert "memory format channels_last (set explicitly)" in capsys.readouterr().out


def test_compile_falls_back_to_eager_with_a_message_naming_the_key():
    module = torch.nn.Linear(3, 2)
    state = compile_stage([module], "stages[0]", CPU, backend="no_such_backend")
    assert state.status == "eager" and state.record()["enabled"] is True
    assert "stages[0].compile" in state.message and "training eagerly" in state.message
    assert "set stages[0].compile: false" in state.message
    assert module(torch.ones(1, 3)).shape == (1, 2)  # still runs, eagerly


def test_compile_wraps_the_module_in_place_and_keeps_its_names():
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    keys = list(module.state_dict())
    state = compile_stage([module], "stages[0]", CPU, backend="eager")  # dynamo without inductor: quick
    assert state.status == "compiled" and list(module.state_dict()) == keys
    module(torch.ones(5, 3)).sum().backward()
    state.finish()
    assert state.compile_s is not None and state.compile_s > 0


def _digits(cfg):
    from cascade_ray.data.source import load_data

    return load_data(cfg.data, cfg.seed)


def test_memory_format_is_decided_by_the_stages_own_module():
    """The encoder sits on a frozen ResNet but has no convolution of its own: contiguous, said so."""
    from cascade_ray.stage.setup import setup_stage

    cfg = _cfg()
    encoder = setup_stage(cfg, 1, _digits(cfg), None, CPU, hardware=AVX2)
    assert (encoder.memory_format, encoder.memory_format_reason) == ("contiguous", "no 2-D convolutions")
    assert "memory format contiguous (no 2-D convolutions)" in encoder.precision_line()
    features = setup_stage(cfg, 0, _digits(cfg), None, CPU, hardware=AVX2)
    assert features.memory_format == "channels_last"
    assert features.model.blocks["features"].stem[0].weight.is_contiguous(memory_format=torch.channels_last)
