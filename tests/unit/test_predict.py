"""Batch prediction without Ray: the input check against a run's spec, the output folder rule, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cascade_ray.cli import build_parser, main
from cascade_ray.data.parquet import SHAPE_METADATA_KEY, write_parquet
from cascade_ray.errors import CascadeError
from cascade_ray.tools.inference import InputError, InputSpec
from cascade_ray.tools.predict import _prepare_out, check_data, default_actors, input_issue, predict_file, work_units

SPEC = InputSpec((1, 8, 8), "class", 10, np.zeros((1, 1, 1), np.float32), np.ones((1, 1, 1), np.float32))


def _schema(kind: pa.DataType, shape: list[int] | None = None, name: str = "image") -> pa.Schema:
    meta = {SHAPE_METADATA_KEY: json.dumps(shape).encode()} if shape else None
    return pa.schema([pa.field(name, kind), pa.field("id", pa.int64())], metadata=meta)


def test_input_fits_stored_shape_flat_rows_and_tensors():
    assert input_issue(_schema(pa.list_(pa.uint8(), 64), [1, 8, 8]), "image", SPEC) is None
    assert input_issue(_schema(pa.list_(pa.float32(), 64)), "image", SPEC) is None  # flat rows
    assert input_issue(_schema(pa.list_(pa.float32()), [64]), "image", SPEC) is None
    assert input_issue(_schema(pa.fixed_shape_tensor(pa.float32(), [1, 8, 8])), "image", SPEC) is None
    assert input_issue(_schema(pa.list_(pa.float32())), "image", SPEC, row_values=64) is None


def test_missing_column_names_the_columns_and_the_flag():
    issue = input_issue(_schema(pa.list_(pa.uint8(), 64), name="pixels"), "image", SPEC)
    assert "no input column 'image'" in issue and "pixels, id" in issue and "--input-column" in issue
    issue = input_issue(_schema(pa.list_(pa.uint8(), 64), name="Image"), "image", SPEC)
    assert "did you mean 'Image'" in issue


def test_wrong_row_length_says_found_and_expected():
    issue = input_issue(_schema(pa.list_(pa.uint8(), 784), [1, 28, 28]), "image", SPEC)
    assert "(1, 28, 28) (784 values)" in issue and "takes (1, 8, 8) (64 values per row)" in issue
    issue = input_issue(_schema(pa.list_(pa.float32())), "image", SPEC, row_values=63)
    assert "63 values" in issue


def test_same_values_in_another_layout_are_refused():
    issue = input_issue(_schema(pa.list_(pa.uint8(), 64), [8, 8, 1]), "image", SPEC)
    assert "shaped (8, 8, 1)" in issue and "another layout" in issue
    issue = input_issue(_schema(pa.fixed_shape_tensor(pa.float32(), [8, 8, 1])), "image", SPEC)
    assert "shaped (8, 8, 1)" in issue


def test_non_numeric_inputs_are_refused():
    assert "is string" in input_issue(_schema(pa.string()), "image", SPEC)
    assert "holds string values" in input_issue(_schema(pa.list_(pa.string(), 64)), "image", SPEC)


def test_default_actors_one_per_gpu_else_one_per_cpu():
    assert default_actors({"CPU": 16, "GPU": 4}) == (4, 1.0)
    assert default_actors({"CPU": 8}) == (8, 0.0)
    assert default_actors({"CPU": 0.5}) == (1, 0.0)


def test_work_units_number_rows_over_files(tmp_path):
    a = _digits_file(tmp_path / "a.parquet", n=10)
    write_parquet(tmp_path / "b.parquet", np.zeros((7, 1, 8, 8), np.uint8), np.zeros(7, np.int64), row_group_rows=3)
    footers = check_data([a, str(tmp_path / "b.parquet")], None, "image", SPEC, [], "d")
    units = work_units([a, "b"], footers)
    assert [(u["file"], u["row_group"], u["start"]) for u in units] == [
        (a, 0, 0),
        ("b", 0, 10),
        ("b", 1, 13),
        ("b", 2, 16),
    ]


def _digits_file(path, n=20, shape=(1, 8, 8)):
    x = np.arange(n * int(np.prod(shape)), dtype=np.uint8).reshape(n, *shape)
    write_parquet(path, x, np.arange(n) % 10)
    return str(path)


def test_check_data_names_the_file_and_counts_rows(tmp_path):
    good = _digits_file(tmp_path / "a.parquet")
    bad = _digits_file(tmp_path / "b.parquet", shape=(1, 4, 4))
    assert sum(m.num_rows for m in check_data([good], None, "image", SPEC, ["label"], "d")) == 20
    with pytest.raises(InputError, match=r"b\.parquet: input column 'image' rows hold \(1, 4, 4\) \(16 values\)"):
        check_data([good, bad], None, "image", SPEC, [], "d")
    with pytest.raises(InputError, match="no column 'idx' to keep"):
        check_data([good], None, "image", SPEC, ["idx"], "d")


def test_check_data_reads_a_variable_list_row(tmp_path):
    table = pa.table({"image": pa.array([[1.0] * 63, [2.0] * 63], pa.list_(pa.float32()))})
    pq.write_table(table, tmp_path / "v.parquet")
    with pytest.raises(InputError, match="63 values"):
        check_data([str(tmp_path / "v.parquet")], None, "image", SPEC, [], "d")


def test_kept_column_may_not_shadow_an_output(tmp_path):
    table = pa.table({"image": pa.array([[1.0] * 64], pa.list_(pa.float32(), 64)), "prediction": [1]})
    pq.write_table(table, tmp_path / "p.parquet")
    with pytest.raises(InputError, match="may not be named 'prediction'"):
        check_data([str(tmp_path / "p.parquet")], None, "image", SPEC, ["prediction"], "d")


def test_out_folder_rules(tmp_path):
    out = tmp_path / "out"
    _prepare_out(out, [], overwrite=False)  # absent: fine
    out.mkdir()
    _prepare_out(out, [], overwrite=False)  # empty: fine
    (out / "part-0.parquet").write_bytes(b"x")
    with pytest.raises(CascadeError, match="not empty .*--overwrite"):
        _prepare_out(out, [], overwrite=False)
    _prepare_out(out, [], overwrite=True)
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CascadeError, match="not Parquet"):
        _prepare_out(out, [], overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    data = _digits_file(out / "in.parquet")
    with pytest.raises(CascadeError, match="holds the input files"):
        _prepare_out(out, [data], overwrite=True)
    with pytest.raises(CascadeError, match="is a file"):
        _prepare_out(out / "notes.txt", [], overwrite=True)


def test_cli_parses_predict_flags():
    args = build_parser().parse_args(
        ["predict", "runs/debug", "--data", "s3://b/new/", "--out", "s3://b/pred", "--keep", "id", "--keep", "t"]
        + ["--actors", "3", "--batch-rows", "256", "--input-column", "pixels", "--overwrite"]
    )
    assert (args.run_dir, args.data, args.out, args.keep) == ("runs/debug", "s3://b/new/", "s3://b/pred", ["id", "t"])
    assert (args.actors, args.batch_rows, args.input_column, args.overwrite, args.address) == (
        3,
        256,
        "pixels",
        True,
        None,
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["predict", "runs/debug", "--out", "o"])  # --data is required


def test_cli_predict_error_is_an_exit_code_before_ray(tmp_path, capsys):
    code = main(["predict", str(tmp_path), "--data", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "o")])
    assert code == 1 and "is not a finished run" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["predict", "serve", "export", "report"])
def test_a_run_folder_that_does_not_exist_is_named_with_the_closest_run(tmp_path, capsys, command):
    """A typo in {storage_path}/{name}: every reader of a run says the folder does not exist and names
    the run beside it, not what a folder that is not there lacks."""
    (tmp_path / "debug").mkdir()
    (tmp_path / "debug" / "config.yaml").write_text("name: debug\n")
    (tmp_path / "other").mkdir()  # not a run: never suggested
    extra = {"predict": ["--data", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "o")]}.get(command, [])
    code = main([command, str(tmp_path / "debgu"), *extra])
    err = capsys.readouterr().err
    assert code == 1 and f"{tmp_path / 'debgu'}: no such run folder; did you mean 'debug'?" in err, err
    assert "config.yaml" not in err and "summary.json" not in err


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(CascadeError, match="--batch-rows: 0"):
        predict_file(tmp_path, tmp_path, tmp_path / "o", batch_rows=0)
    with pytest.raises(CascadeError, match="--actors: 0"):
        predict_file(tmp_path, tmp_path, tmp_path / "o", actors=0)


def test_an_actors_error_is_found_behind_rays_wrapper_without_ray_datas_retry_note():
    """What predict raises when an actor's row check fails: the DataError itself (not Ray's wrapper of
    it, whose text is the actor's stack), without the retry advice Ray Data appends to its message."""
    import ray.exceptions

    from cascade_ray.errors import DataError
    from cascade_ray.tools.predict import _ours

    bad = DataError(
        "--data: a.parquet row group 2, row 5, input column 'image': input 'image' holds NaN/Inf; fix it"
        "\nFailed to apply UDF transform after 1/1 attempts (total backoff 0.0s).\nTo change retry attempts, ..."
    )
    wrapped = ray.exceptions.RayTaskError("MapWorker.submit", "Traceback (most recent call last): ...", bad)
    found = _ours(wrapped.as_instanceof_cause())
    assert found is bad and str(found) == "--data: a.parquet row group 2, row 5, input column 'image': " + (
        "input 'image' holds NaN/Inf; fix it"
    )
    assert _ours(RuntimeError("not ours")) is None


def test_report_on_a_folder_of_sweeps_only_says_where_their_tables_are(tmp_path, capsys):
    """cascade-ray tune leaves tune/<stage>/results.parquet and no summary.json: the report names the
    sweeps and how to get a run whose report shows them, not only that summary.json is missing."""
    table = tmp_path / "debug" / "tune" / "classifier" / "results.parquet"
    table.parent.mkdir(parents=True)
    table.write_bytes(b"PAR1")  # its presence is what counts here
    code = main(["report", str(tmp_path / "debug")])
    err = capsys.readouterr().err
    assert code == 1 and "holds only sweeps (classifier: cascade-ray tune writes no summary.json)" in err, err
    assert "cascade-ray run CONFIG .../best.yaml" in err
