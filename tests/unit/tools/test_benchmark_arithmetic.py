"""tools/benchmark.py's arithmetic, without a launcher: the settings benchmark's comparisons and the parallel
benchmark's rounds (tools/bench/). The export benchmark's memory sampling starts a child process, so it
is in tests/integration/benchmarks/test_benchmark_memory.py."""

from bench.settings.benchmark import PARITY_TOL, VARIANTS, summarise


def test_settings_benchmark_arithmetic():
    """`benchmark.py settings`: each variant is compared with the shipped config it modifies (the last
    variant without a fragment before it), on speed after the warm-up steps and on per-step losses."""
    names = [name for name, *_ in VARIANTS]
    shipped2, shipped3 = [name for name, _, fragment in VARIANTS if not fragment]  # the shipped baselines
    overlap, z3_variant = names[names.index(shipped2) + 1], names[names.index(shipped3) + 1]
    runs = {n: [{"losses": [8.0, 7.0, 6.0], "tokens_per_sec": [1.0, 100.0, 100.0]}] for n in names}
    runs[overlap] = [{"losses": [8.0, 7.0, 6.5], "tokens_per_sec": [1.0, 150.0, 250.0]}]
    runs[shipped3] = [
        {"losses": [9.0, 7.0, 6.0], "tokens_per_sec": [1.0, 50.0, 50.0]},
        {"losses": [9.0, 7.0, 6.0], "tokens_per_sec": [1.0, 70.0, 70.0]},
    ]
    out = summarise(runs, skip=1)
    assert out[overlap]["tokens_per_sec"] == 200.0 and out[overlap]["vs_shipped"] == 2.0  # warm-up step left out
    assert out[overlap]["max_abs_loss_delta"] == 0.5 and not out[overlap]["loss_parity"]
    assert out[shipped2]["vs_shipped"] == 1.0 and out[shipped2]["loss_parity"]
    assert out[shipped3]["tokens_per_sec"] == 60.0 and out[shipped3]["windows"] == 4
    assert out[z3_variant]["vs_shipped"] == 100.0 / 60.0  # ZeRO-3 variants compare with zero3.json, not zero2.json
    assert out[z3_variant]["max_abs_loss_delta"] == 1.0 > PARITY_TOL


def test_parallel_benchmark_rounds_rotate_and_ratios_stay_within_a_round():
    """`benchmark.py parallel`: each configuration takes each place in turn, and a configuration's ratio to
    ZeRO-2 is taken against ZeRO-2's run of the same round (drift between rounds cancels), after the warm-up."""
    from bench.parallel.benchmark import BASELINE, CONFIGS, max_loss_delta, round_orders, round_ratios

    names = list(CONFIGS)
    orders = round_orders(names, 5)
    assert orders[0] == names and orders[1] == names[1:] + names[:1] and orders[4] == names
    for place in range(len(names)):  # over a full rotation every configuration is in every place once
        assert sorted(o[place] for o in orders[:4]) == sorted(names)
    slow, fast = {"tokens_per_sec": [1.0, 50.0, 60.0, 70.0]}, {"tokens_per_sec": [1.0, 100.0, 120.0, 140.0]}
    rounds = [
        {BASELINE: slow, "TP": {"tokens_per_sec": [9.0, 25.0, 30.0, 35.0]}},  # a loaded round: both halve
        {BASELINE: fast, "TP": {"tokens_per_sec": [9.0, 100.0, 120.0, 140.0]}},
    ]
    r = round_ratios(rounds, skip=1)
    assert r[BASELINE] == [1.0, 1.0] and r["TP"] == [0.5, 1.0]
    assert abs(max_loss_delta({"losses": [8.0, 7.5]}, {"losses": [8.25, 7.5]}) - 0.25) < 1e-12


def test_parallel_benchmark_feeds_every_configuration_one_global_batch():
    """Loss parity needs the same rows per step: micro-batch x data-parallel replicas is the same for all."""
    from bench.parallel.benchmark import CONFIGS, SIZES, launch

    micro = SIZES["cpu"]["micro"]
    globals_ = set()
    for name, (ranks, files, multiple) in CONFIGS.items():
        cmd = launch(name, SIZES["cpu"], 3, "fp32", "out", ["train.py"])
        tp = 2 if "ds_configs/tp2.json" in files else 1
        per_device = int(cmd[cmd.index("--per_device_train_batch_size") + 1])
        assert per_device == micro * multiple and cmd[cmd.index("--num_gpus") + 1] == str(ranks)
        globals_.add(per_device * ranks // tp)
    assert globals_ == {2 * micro}
