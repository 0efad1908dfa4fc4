"""Every command line refuses a bad option before any work, with a usage error
(exit status 2) that names the option (docs/design.md, bad input): numbers out
of range, output files in folders that do not exist, options that contradict
each other, rates that would print NaN. And every help text says each default
once.

In one process: each command's ``main`` runs with its bad options, its work
replaced by a function that fails the test if called; `mpi_impl`'s options go
through its parser and `check_args`, as every rank runs them before MPI moves
anything.

    .venv/bin/python -m pytest tests/project/test_command_lines.py -q
"""

import argparse
import importlib

import pytest

from mpi_impl import cli

MISSING = "/no/such/folder"

# command -> (module with main, the functions that do its work)
COMMANDS = {
    "reference": ("reference.__main__", ("ring_attention", "attention")),
    "reference.cost": ("reference.cost", ("predict", "scheme_table")),
    "reference.tms": ("reference.tms", ("theoretical_max_speedup", "paper_rows")),
    "reference.testing": ("reference.testing.__main__", ("check_plan", "replay", "run_measure")),
    "model": ("model.__main__", ("run_layouts",)),
    "bench.kernel": ("bench.kernel", ("run", "rerun_with_machine_kernels")),
    "bench.virtual_ring": ("bench.virtual_ring", ("run",)),
    "bench.scale": ("bench.scale", ("run",)),
    "bench.block_shapes": ("bench.block_shapes", ("report",)),
    "bench.tile_parts": ("bench.tile_parts", ("report",)),
    "bench.unit_shapes": ("bench.unit_shapes", ("report",)),
    "bench.paper": ("bench.paper", ("run",)),
    "bench.predicted": ("bench.predicted", ("run",)),
    "bench.model_step": ("bench.model_step", ("run", "worker")),
    "bench.paper_code": ("bench.paper_code", ("compare", "jax_worker")),
    "bench.soak": ("bench.soak", ("run",)),
    "bench.run": ("bench.run", ("run_section",)),
}

# (command, its options, the option the error names)
BAD = [
    ("reference", "--seq-len 0", "--seq-len"), ("reference", "--seq-len -4", "--seq-len"),
    ("reference", "--n-devices 0", "--n-devices"), ("reference", "--tile-size 0", "--tile-size"),
    ("reference", "--heads 0", "--heads"), ("reference", "--heads -1", "--heads"),
    ("reference", "--head-dim 0", "--head-dim"), ("reference", "--threads 0", "--threads"),
    ("reference", "--threads 2", "--threads"), ("reference", "--blas-threads 0", "--blas-threads"),
    ("reference", "--step v1 --threads -1", "--threads"), ("reference", "--seed -1", "--seed"),

    ("reference.cost", "--seq-len 0", "--seq-len"), ("reference.cost", "--seq-len -8", "--seq-len"),
    ("reference.cost", "--n-devices 0", "--n-devices"), ("reference.cost", "--tile-size 0", "--tile-size"),
    ("reference.cost", "--window 0", "--window"), ("reference.cost", "--window -3", "--window"),
    ("reference.cost", "--seq-len 400 --doc-lengths 100,200", "--doc-lengths"),
    ("reference.cost", "--seq-len 300 --doc-lengths 100,-5,205", "--doc-lengths"),
    ("reference.cost", "--doc-lengths 1,x", "--doc-lengths"),
    ("reference.cost", "--scheme all --heads 32 --kv-heads 5", "--kv-heads"),
    ("reference.cost", "--scheme all --heads 0", "--heads"), ("reference.cost", "--scheme all --kv-heads 0", "--kv-heads"),
    ("reference.cost", "--scheme all --heads -1", "--heads"), ("reference.cost", "--scheme all --batch 0", "--batch"),
    ("reference.cost", "--scheme all --head-dim 0", "--head-dim"),
    ("reference.cost", "--scheme all --tflops -1", "--tflops"), ("reference.cost", "--scheme all --tflops 0", "--tflops"),
    ("reference.cost", "--scheme all --tflops nan", "--tflops"),
    ("reference.cost", "--scheme all --link-gbs 0", "--link-gbs"),
    ("reference.cost", "--scheme all --link-gbs -3", "--link-gbs"),
    ("reference.cost", "--scheme all --link-gbs inf", "--link-gbs"),
    ("reference.cost", "--scheme all --memory-gib 0", "--memory-gib"),
    ("reference.cost", "--scheme all --memory-gib -1", "--memory-gib"),
    ("reference.cost", "--scheme nope", "--scheme"), ("reference.cost", "--scheme ring --n-devices 0", "--n-devices"),
    ("reference.cost", "--scheme all --tile-size -2", "--tile-size"),
    ("reference.cost", "--scheme ulysses --n-devices 8 --heads 12 --kv-heads 12", "ulysses"),
    ("reference.cost", "--scheme double_ring --n-devices 2", "double_ring"),
    ("reference.cost", "--scheme all --ranks-per-node 0", "--ranks-per-node"),
    ("reference.cost", "--scheme all --intra 0", "--intra"), ("reference.cost", "--scheme all --inter -2", "--inter"),
    ("reference.cost", "--scheme all --inter-latency-us -1", "--inter-latency-us"),
    ("reference.cost", "--scheme all --intra-latency-us nan", "--intra-latency-us"),
    ("reference.cost", "--scheme all --machine nope", "--machine"),
    ("reference.cost", "--scheme all --ranks-per-node 2 --intra 450", "--inter"),
    ("reference.cost", "--scheme all --machine h100-ndr --link-gbs 10", "--link-gbs"),

    ("reference.tms", "--model 7B --seq-parallel 0", "--seq-parallel"),
    ("reference.tms", "--model 7B --n-seq 0", "--n-seq"),
    ("reference.tms", "--model 7B --n-seq 1000 --seq-parallel 3", "--n-seq"),
    ("reference.tms", "--model 7B --seq-parallel -2", "--seq-parallel"),
    ("reference.tms", "--seq-parallel 8", "--seq-parallel"), ("reference.tms", "--n-seq 4096", "--n-seq"),
    ("reference.tms", "--model 9B", "--model"),

    ("model", "--heads -1", "--heads"), ("model", "--heads 0", "--heads"), ("model", "--heads 3", "--heads"),
    ("model", "--heads 64", "--heads"), ("model", "--d-model 0", "--d-model"), ("model", "--layers 0", "--layers"),
    ("model", "--d-ff 0", "--d-ff"), ("model", "--lr 0", "--lr"), ("model", "--lr -1", "--lr"),
    ("model", "--lr nan", "--lr"), ("model", "--tile-size 0", "--tile-size"),
    ("model", f"--plot {MISSING}/x.png", "--plot"), ("model", f"--out {MISSING}/x.npz", "--out"),
    ("model", "--n-devices 0", "--n-devices"), ("model", "--period 0", "--period"), ("model", "--steps 0", "--steps"),
    ("model", "--vocab 0", "--vocab"), ("model", "--batch 0", "--batch"), ("model", "--period 300", "--period"),

    ("reference.testing", f"check test_kit:ToyRing --markdown {MISSING}/v.md", "--markdown"),
    ("reference.testing", "check test_kit:ToyRing --markdown /tmp", "--markdown"),
    ("reference.testing", "check test_kit:ToyRing --examples 0", "--examples"),
    ("reference.testing", "check test_kit:ToyRing --examples -1", "--examples"),
    ("reference.testing", "check test_kit:ToyRing --max-seq 0", "--max-seq"),
    ("reference.testing", "check test_kit:ToyRing --shrink-seconds -1", "--shrink-seconds"),
    ("reference.testing", "check test_kit:ToyRing --shapes -1", "--shapes"),
    ("reference.testing", "check test_kit:ToyRing --world-sizes 0", "--world-sizes"),
    ("reference.testing", "check test_kit:ToyRing --world-sizes 2,x", "--world-sizes"),
    ("reference.testing", "measure --examples 0", "--examples"),
    ("reference.testing", "measure --growth 0", "--growth"), ("reference.testing", "measure --growth -1", "--growth"),

    ("bench.kernel", "--threads 0", "--threads"), ("bench.kernel", "--threads -2", "--threads"),
    ("bench.kernel", "--results {file}", "--results"), ("bench.kernel", "--torch-python /no/such/python", "--torch-python"),
    ("bench.kernel", "--step nope", "--step"), ("bench.kernel", "--tiny --full", "--full"),
    ("bench.virtual_ring", "--seq-len 0", "--seq-len"), ("bench.virtual_ring", "--n-devices 0", "--n-devices"),
    ("bench.virtual_ring", "--tile 0", "--tile"), ("bench.virtual_ring", "--repeats 0", "--repeats"),
    ("bench.scale", "--tile 0", "--tile"), ("bench.scale", "--step nope", "--step"), ("bench.scale", "--ranks 0", "--ranks"),
    ("bench.scale", "--seq-lens 0", "--seq-lens"), ("bench.scale", "--seq-lens 1000 --ranks 3", "--seq-lens"),
    ("bench.block_shapes", "--seq-len 0", "--seq-len"), ("bench.block_shapes", "--n-devices 0", "--n-devices"),
    ("bench.block_shapes", "--heads 0", "--heads"), ("bench.block_shapes", "--head-dim 0", "--head-dim"),
    ("bench.block_shapes", "--tile-size 0", "--tile-size"), ("bench.block_shapes", "--repeats 0", "--repeats"),
    ("bench.block_shapes", "--seq-len 100 --n-devices 3", "--seq-len"),
    ("bench.tile_parts", "--seq-len 0", "--seq-len"), ("bench.tile_parts", "--repeats 0", "--repeats"),
    ("bench.tile_parts", "--tile-size 0", "--tile-size"),
    ("bench.unit_shapes", "--seq-len 0", "--seq-len"), ("bench.unit_shapes", "--rows 0", "--rows"),
    ("bench.unit_shapes", "--join 0", "--join"),
    ("bench.paper", "--results {file}", "--results"), ("bench.predicted", "--results {file}", "--results"),
    ("bench.model_step", "--results {file}", "--results"), ("bench.model_step", "--seqs 0 --worker x.json", "--seqs"),
    ("bench.paper_code", "--bpt {file} --seq-len 0", "--seq-len"),
    ("bench.paper_code", "--bpt {file} --n-devices 0", "--n-devices"),
    ("bench.paper_code", "--bpt {file} --tiles 0", "--tiles"), ("bench.paper_code", "--bpt {file} --repeats 0", "--repeats"),
    ("bench.paper_code", "--bpt {file} --step nope", "--step"), ("bench.paper_code", f"--bpt {MISSING}/bpt.py", "--bpt"),
    ("bench.soak", "--calls 0", "--calls"),
    ("bench.run", "--out {folder}", "--out"), ("bench.run", "--only nope", "--only"),
    ("bench.run", "--results {file}", "--results"),
]

# mpi_impl's options (and gpu_impl's: the same parser and check), on 2 ranks
MPI_BAD = [
    ("--link-gbs 0", "--link-gbs"), ("--link-gbs -1", "--link-gbs"), ("--link-gbs nan", "--link-gbs"),
    ("--dropout 1.5", "--dropout"), ("--dropout -0.1", "--dropout"), ("--dropout nan", "--dropout"),
    ("--window 0", "--window"), ("--window -2", "--window"), ("--seq-len 0", "--seq-len"), ("--seq-len -5", "--seq-len"),
    ("--heads 0", "--heads"), ("--kv-heads 3", "--kv-heads"), ("--kv-heads 0", "--kv-heads"),
    ("--repeat 0", "--repeat"), ("--threads 0", "--threads"), ("--blas-threads 0", "--blas-threads"),
    ("--tile-size 0", "--tile-size"), ("--backward-tile-size 0", "--backward-tile-size"),
    (f"--plot {MISSING}/x.png", "--plot"), ("--plot {folder}", "--plot"),
    (f"--trace-out {MISSING}/x.json", "--trace-out"), ("--doc-lengths 100,200", "--doc-lengths"),
    ("--cu-seqlens 0,5", "--cu-seqlens"), ("--cu-seqlens 0,10,5,2048", "--cu-seqlens"),
    ("--scheme usp --ulysses-degree 3", "--ulysses-degree"), ("--scheme usp", "--ulysses-degree"),
    ("--scheme usp --ulysses-degree 0", "--ulysses-degree"), ("--batch 0", "--batch"), ("--head-dim 0", "--head-dim"),
    ("--scheme double_ring", "--ring-inner"), ("--scheme double_ring --ring-inner 3", "--ring-inner"),
    ("--scheme double_ring --ring-inner 0", "--ring-inner"), ("--ring-inner 2", "--ring-inner"),
    ("--scheme usp --ulysses-degree 2 --kv-heads 3 --heads 6", "--ulysses-degree"),
    ("--seed -1", "--seed"),
    ("--ranks-per-node 0", "--ranks-per-node"), ("--intra 0", "--intra"), ("--inter nan", "--inter"),
    ("--inter-latency-us -5", "--inter-latency-us"), ("--ranks-per-node 1 --inter 1", "--intra"),
    ("--placement across", "--placement"), ("--placement ring-in-nodes", "--placement"),
    ("--ranks-per-node 1 --intra 1 --inter 1 --placement ring-in-nodes", "--placement"),
    ("--ranks-per-node 1 --intra 1 --inter 1 --link-gbs 5", "--link-gbs"),
]


def _fill(text, tmp_path):
    (tmp_path / "a_file").write_text("")
    return text.format(file=tmp_path / "a_file", folder=tmp_path).split()


class WorkBegan(AssertionError):
    pass


@pytest.mark.parametrize("command, options, option", BAD, ids=[f"{c} {o}" for c, o, _ in BAD])
def test_a_bad_option_is_a_usage_error_before_any_work(command, options, option, tmp_path, monkeypatch, capsys):
    module_name, work = COMMANDS[command]
    module = importlib.import_module(module_name)
    for name in work:
        monkeypatch.setattr(module, name, lambda *a, **k: (_ for _ in ()).throw(WorkBegan(f"{command} began")))
    with pytest.raises(SystemExit) as stop:
        module.main(_fill(options, tmp_path))
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert "error:" in err and option in err.split("error:", 1)[1], err


@pytest.mark.parametrize("options, option", MPI_BAD, ids=[o for o, _ in MPI_BAD])
def test_a_bad_mpi_option_is_refused_by_every_rank_before_mpi_moves_anything(options, option, tmp_path, capsys):
    try:
        args = cli.build_parser().parse_args(_fill(options, tmp_path))
    except SystemExit as stop:
        assert stop.code == 2 and f"argument {option}" in capsys.readouterr().err
        return
    problem = cli.check_args(args, 2)
    assert problem is not None and option in problem, problem


def parsers():
    """(name, parser) of every command line above, and mpi_impl's and gpu_impl's."""
    found = {"mpi_impl": cli.build_parser()}
    gpu = importlib.import_module("gpu_impl.__main__")
    found["gpu_impl"] = gpu.build_parser()
    for command, (module_name, _) in COMMANDS.items():
        kept = []

        def keep(self, args=None, namespace=None):
            kept.append(self)
            raise WorkBegan("parsed")
        original = argparse.ArgumentParser.parse_args
        argparse.ArgumentParser.parse_args = keep
        try:
            importlib.import_module(module_name).main(["--help"])
        except (WorkBegan, SystemExit):
            pass
        finally:
            argparse.ArgumentParser.parse_args = original
        found[command] = kept[0]
    return found


def test_every_help_says_each_default_once():
    for name, ap in parsers().items():
        subparsers = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
        for parser in [ap] + [p for s in subparsers for p in s.choices.values()]:
            formatter = parser._get_formatter()
            for action in parser._actions:
                if action.help in (None, argparse.SUPPRESS):
                    continue
                text = formatter._expand_help(action)
                assert text.lower().count("default") <= 1, f"{name} {action.option_strings}: {text}"
                assert "(default: None)" not in text, f"{name} {action.option_strings}: {text}"


def test_the_cost_models_sequence_follows_its_documents_when_not_given(capsys):
    """`reference.cost --doc-lengths 100,200` predicts 300 tokens, not the default 4096 it would refuse."""
    from reference import cost
    cost.main(["--doc-lengths", "100,200", "--n-devices", "2", "--tile-size", "16"])
    assert capsys.readouterr().out.startswith("S=300 N=2 tile=(16, 16) documents=[100, 200]")
