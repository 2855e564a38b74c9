"""The experiment runner: bad input fails early and clearly; quickstart writes its report."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from mfopt import data, runner


def _raises(match, name, *overrides, quick=True):
  with pytest.raises(runner.ConfigError, match=match):
    runner.prepare(name, quick=quick, overrides=list(overrides))


def test_unknown_experiment_names_it_and_lists_known():
  _raises(r"unknown experiment 'nope'.*quickstart", "nope")
  _raises(r"'profile_step' is a tool .*python -m experiments.profile_step --help", "profile_step")
  _raises(r"'bench_update' is a tool", "bench_update")


def test_unknown_config_key():
  _raises(r"unknown config key 'num_stepz'", "quickstart", "num_stepz=3")
  _raises(r"unknown config key 'model.width'", "quickstart", "model.width=3")


def test_a_key_given_twice_on_the_command_line_is_refused(tmp_path, capsys):
  # (it was last-wins: base_lr=0.1 base_lr=0.2 ran with 0.2 and said nothing); a caller of
  # run_experiment may still append to a base list (the later value wins)
  assert runner.main(["quickstart", "--quick", "--workdir", str(tmp_path), "num_steps=7",
                      "num_steps=8"]) == 2
  assert ("error: config field 'num_steps' is given twice: 'num_steps=7' and 'num_steps=8'"
          in capsys.readouterr().err)
  assert not (tmp_path / "config.json").exists()
  _, c = runner.prepare("quickstart", quick=True, overrides=["num_steps=7", "num_steps=8"])
  assert c.num_steps == 8
  # dotted keys: two fields of one group are two keys, one field twice is refused
  runner.refuse_repeated_keys(["model.width=8", "model.depth=3", "modelx=1"])
  with pytest.raises(runner.ConfigError, match=r"'model.width' is given twice: 'model.width=8' "
                                               r"and 'model.width=9'"):
    runner.refuse_repeated_keys(["model.width=8", "model.depth=3", "model.width=9"])


def test_a_batch_larger_than_the_dataset_is_one_error_line(tmp_path, capsys):
  """A global batch over the dataset size is found when the data loads (after the run's
  directory exists): one 'error:' line and exit code 2, as for a bad config value, not a
  traceback; the library's own callers get data.BatchTooLargeError, a ValueError."""
  args = ["hybrid_vs_baselines", "--quick", "--workdir", str(tmp_path), "progress=false"]
  assert runner.main(args + ["num_train=8"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and re.fullmatch(
      r"error: global batch .* exceeds the dataset size 8 \(.*\)", err[0]), err
  with pytest.raises(data.BatchTooLargeError):
    runner.run_experiment("hybrid_vs_baselines", quick=True, workdir=tmp_path,
                          overrides=["progress=false", "num_train=8"])


def test_an_interrupt_says_how_to_resume(tmp_path, capsys, monkeypatch):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(runner, "_run_prepared", interrupted)
  assert runner.main(["quickstart", "--quick", "--workdir", str(tmp_path)]) == 130
  assert "quickstart: interrupted; run the same command again to resume" in (
      capsys.readouterr().err)


@pytest.mark.parametrize("override,match", [
    ("num_steps=ten", r"'num_steps' expects int.*'ten'"),
    ("num_steps=1.5", r"'num_steps' expects int.*'1.5'"),
    ("seed=[1]", r"'seed' expects int"),
    ("progress=maybe", r"'progress' expects bool.*'maybe'"),
    ("datasets=[3]", r"'datasets' expects a tuple of strings"),
])
def test_wrong_type(override, match):
  _raises(match, "quickstart", override)


def test_settings_that_void_a_comparison_are_refused():
  """An off-default review: a warm-up longer than the run left the hybrid in AdaBound (judged
  as the hybrid) and ADPSGD averaging every step (judged against FULLSGD as if adaptive); an
  odd B gave bn_strategies' row 1 batches of mean 14/3 instead of B = 5."""
  _raises(r"'warmup_epochs' must be in \(0, epochs=2\) .*, got 5.0", "hybrid_vs_baselines",
          "warmup_epochs=5", "epochs=2")
  _raises(r"'warmup_epochs'", "precision", "warmup_epochs=2.5")  # quick: 2 epochs
  _raises(r"'per_worker_batch' must be an even number >= 2 .* got 5", "bn_strategies",
          "per_worker_batch=5")
  _raises(r"'warmup_epochs' must be in \(0, epochs=2\) \(the hybrid must reach its SGD "
          r"phase\), got 2.0", "hybrid_vs_baselines", "warmup_epochs=2")  # T = epochs
  runner.prepare("hybrid_vs_baselines", quick=True, overrides=["warmup_epochs=1.5"])
  from experiments import _averaging_common
  _, c = runner.prepare("adpsgd_table", quick=True, overrides=["warmup_epochs=2"])
  with pytest.raises(runner.ConfigError,
                     match=r"'warmup_epochs' = 2.0 is 22 steps \(11 per epoch\) of a "
                           r"num_steps=16 run: .*use warmup_epochs < 1.409"):
    _averaging_common.adpsgd_warmup_steps(c, 11)
  assert _averaging_common.adpsgd_warmup_steps(c, 4) == 8  # 2 epochs of 4 steps: < 16


def test_quickstart_refuses_a_global_batch_larger_than_a_dataset(tmp_path):
  """An epoch of 0 steps: the hybrid row divided by it (ZeroDivisionError) after the rows
  before it had trained. Refused before anything trains, naming the field and the size."""
  with pytest.raises(runner.ConfigError,
                     match=r"'global_batch' = 1600 exceeds dataset 'digits'.s 1437 training"):
    runner.run_experiment("quickstart", quick=True, workdir=tmp_path, overrides=[
        "global_batch=1600", "datasets=(digits,)", "models=(mlp,)", "sim_runs=()"])
  assert not (tmp_path / "metrics.jsonl").exists()


def test_tuple_items_and_real_fields_are_typed():
  """A review's findings: a float tuple took True and '0.2' (as 1.0 and 0.2), and fields that
  take fractions had int defaults (warmup_epochs = 1, warmup_values = (1, 2)) and refused 0.5;
  their defaults are floats now."""
  _raises(r"'small_batch_lrs' expects a tuple of numbers .*'\(0.1, True\)'", "adpsgd_table",
          "small_batch_lrs=(0.1, True)")
  _raises(r"'small_batch_lrs' expects a tuple of numbers", "adpsgd_table",
          "small_batch_lrs=(0.1, '0.2')")
  _raises(r"'warmup_epochs' expects a number \(current value 1.0\), got 'True'",
          "hybrid_vs_baselines", "warmup_epochs=True")
  # an integer field stays one (the seed-004 runs take epochs x steps per epoch steps)
  _raises(r"'epochs' expects int \(current value 2\), got '2.0'", "hybrid_vs_baselines",
          "epochs=2.0")
  _raises(r"'workers' expects a tuple of integers", "mf_sweep", "workers=(8, 2.5)")
  _raises(r"'num_steps' expects int", "quickstart", "num_steps=1.5")  # an integer field
  _, c = runner.prepare("hybrid_warmup_T", quick=True, overrides=["warmup_values=(0.5, 1)"])
  assert c.warmup_values == (0.5, 1.0)
  _, c = runner.prepare("hybrid_vs_baselines", quick=True, overrides=["warmup_epochs=0.5"])
  assert c.warmup_epochs == 0.5
  _, c = runner.prepare("adpsgd_table", quick=True, overrides=["learning_rate=2"])
  assert c.learning_rate == 2.0 and isinstance(c.learning_rate, float)  # keeps its float type


@pytest.mark.parametrize("override,match", [
    ("num_steps=0", r"'num_steps' must be positive, got 0"),
    ("num_workers=-8", r"'num_workers' must be positive, got -8"),
    ("global_batch=0", r"'global_batch' must be positive, got 0"),
    ("global_batch=100", r"global_batch must be divisible by num_workers=8.*100"),
    ("datasets=('digits','cifar')", r"'datasets' must be one of"),
    ("algorithms=('sgd',)", r"'algorithms' must be one of"),
])
def test_bad_values(override, match):
  _raises(match, "quickstart", override)


@pytest.mark.parametrize("name,override,match", [
    # values that once ran to the end, or failed late with a traceback (a review's findings)
    ("adpsgd_variance", "momentum=-1.0", r"'momentum' must be in \[0, 1\), got -1.0"),
    ("mf_mlp", "epochs=nan", r"'epochs' must be a positive number, got nan"),
    ("quickstart", "seed=-1", r"'seed' must be a non-negative integer, got -1"),
    ("hybrid_warmup_T", "net=foo", r"'net' must be one of \['1gbit'.*got 'foo'"),
    ("adpsgd_variance", "model=bogus", r"'model' must be one of.*got 'bogus'"),
    ("adpsgd_variance", "dataset=bogus", r"'dataset' must be one of.*got 'bogus'"),
    ("async_convergence", "ssp_staleness=-1", r"'ssp_staleness' must be a non-negative integer"),
    ("async_convergence", "straggler_prob=-1.0", r"'straggler_prob' must be in \[0, 1\]"),
    ("hybrid_vs_baselines", "weight_decay=-1.0", r"'weight_decay' must be a non-negative number"),
    ("block_momentum_mu_vs_p", "momenta=(0.5,1.0)", r"'momenta' must be in \[0, 1\) \(each item\)"),
    ("mf_sweep", "seeds=(0,-1)", r"'seeds' must be a non-negative integer \(each item\)"),
    ("quickstart", "models=lstm_lm", r"'models' must be one of \['mlp', 'cnn', 'resnet18', 'resnet50'\]"),
    # session 13's audit: these ran nothing and said "done", or failed after earlier runs trained
    ("mf_mlp", "mfs=()", r"'mfs' must not be empty \(the run would do nothing\), got \(\)"),
    ("async_convergence", "strategies=()", r"'strategies' must not be empty"),
    # session 24: fields a config does not use ran as if not given, under a report that
    # printed them ("model mlp (features (64,)), BN strategy sync" over an MLP without BN)
    ("hybrid_vs_baselines", "model=mlp features=(64,)",
     r"'features' is not used here: model='mlp' takes no channel widths .*got features=\(64,\)"),
    ("hybrid_warmup_T", "model=mlp bn=sync",
     r"'bn' is not used here: model='mlp' is not built with a BN"),
    ("precision", "comm_dtype=bfloat16", r"'comm_dtype' is not used here: each policy sets"),
    ("bn_strategies", "bn=moving_average", r"'bn' is not used here: each row of bn_strategies"),
    ("async_scaling", "num_workers=8", r"'num_workers' is not used here: worker_counts=\(1, 2, 4"),
    # session 24: a repeated seed or sweep value ran the cell twice and reported "+- 0.000"
    ("mf_mlp", "seeds=(0,0)", r"'seeds' repeats 0 \(a repeated item runs the same cell twice"),
    ("mf_sweep", "mfs=(0.9,0.99,0.9)", r"'mfs' repeats 0.9 .*got \(0.9, 0.99, 0.9\)"),
    ("async_convergence", "strategies=(ASP,BSP,ASP)", r"'strategies' repeats 'ASP'"),
    ("block_momentum_table", "pairs=(('digits','mlp'),('digits','mlp'))",
     r"'pairs' repeats \('digits', 'mlp'\)"),
    ("async_convergence", "easgd_interval=0", r"'easgd_interval' must be a positive integer, got 0"),
    ("block_momentum_table", "mlp_hidden=(0,)", r"'mlp_hidden' must be a positive integer \(each"),
    ("block_momentum_table", "pairs=(('digits','mlp'),('digits','resnet9'))",
     r"'pairs' item 1: model 'resnet9' is not one this experiment can use: \['mlp'"),
    # session 16's audit: names the experiment cannot build passed, then crashed in its run
    ("block_momentum_table", "pairs=(('digits','lstm_lm'),)", r"model 'lstm_lm' is not one"),
    ("adpsgd_variance", "model=cnn", r"'model' must be one of \['mlp'\], got 'cnn'"),
    ("adpsgd_table", "model=cnn", r"'model' must be one of \['mlp'\], got 'cnn'"),
    ("bn_strategies", "model=mlp", r"'model' must be one of \['cnn'\], got 'mlp'"),
    ("hybrid_vs_baselines", "model=lstm_lm",
     r"'model' must be one of \['mlp', 'cnn', 'resnet18', 'resnet50'\]"),
    ("mf_batch_workers", "dataset=textcorpus", r"'dataset' must be one of \['cifar10'.*'textcorpus'"),
    ("mf_lstm", "dataset=digits", r"'dataset' must be one of \['textcorpus', 'tiny_shakespeare'\]"),
    ("ksync_trace", "dataset=tiny_shakespeare", r"'dataset' must be one of .*got 'tiny_shakespeare'"),
    ("adpsgd_table", "decreasing_periods=(4,)", r"'decreasing_periods' must hold two periods"),
    # session 17: quickstart's first error listed datasets its validate then refused
    ("quickstart", "datasets=foo",
     r"'datasets' must be one of \['digits', 'mnist1d'\], got \('foo',\)"),
    # session 17: a ResNet with sim_runs crashed in the simulator after its train.fit rows ran
    ("quickstart", "models=('mlp','resnet18')",
     r"'models' may only name \['mlp', 'cnn'\] when sim_runs .*got \['resnet18'\]"),
])
def test_field_conventions_are_checked_in_every_experiment(name, override, match):
  _raises(match, name, *override.split(" "))  # (no override here holds a space)


def test_every_preset_meets_the_field_conventions():
  names = runner.list_experiments()
  assert "quickstart" in names and "profile_step" not in names  # a tool, not an experiment
  for name in names:
    module = runner.load_experiment(name)
    for quick in (False, True):
      runner.check_conventions(module.get_config(quick))


def test_a_repeat_is_refused_by_its_first_repeated_item_and_allowed_in_layout_fields():
  """A repeated sweep value or seed ran the same cell twice; the error names the first item
  seen again. One thing's layout (layer widths, a schedule of periods) and quickstart's
  datasets/models, read in pairs, may repeat an item."""
  import ml_collections
  with pytest.raises(runner.ConfigError, match=r"'seeds' repeats 2 \(a repeated item"):
    runner.check_conventions(ml_collections.ConfigDict({"seeds": (1, 2, 2, 1)}))
  for name, value in (("hidden", (64, 64)), ("mlp_hidden", (8, 8)), ("features", (4, 4)),
                      ("decreasing_periods", (4, 4)), ("datasets", ("digits", "digits")),
                      ("models", ("mlp", "mlp"))):
    runner.check_conventions(ml_collections.ConfigDict({name: value}))  # (no error)
  # quickstart reads datasets and models in pairs: one dataset under two models is legal
  _, c = runner.prepare("quickstart", quick=True,
                        overrides=["datasets=('digits','digits')", "models=('mlp','cnn')"])
  assert tuple(c.datasets) == ("digits", "digits")


def test_seed004_experiments_take_a_tfds_classification_dataset():
  """Their CHOICES name every classification dataset, and a second list in their validation
  refused all but mnist1d and digits (they run on mock CIFAR-10 end to end)."""
  for name in ("hybrid_vs_baselines", "hybrid_warmup_T", "precision", "bn_strategies",
               "mf_mlp"):
    _, c = runner.prepare(name, quick=True, overrides=["dataset=cifar10"])
    assert c.dataset == "cifar10"
  _raises(r"'dataset' must be one of .*got 'tiny_shakespeare'", "precision",
          "dataset=tiny_shakespeare")  # (a language-model dataset is still refused)


def test_the_cli_runs_user_code_registered_models_and_a_user_experiment(tmp_path, monkeypatch,
                                                                        capsys):
  """`python -m experiments` could not see user code: a registered model was refused by every
  classifier experiment (a frozen name list), and an experiment had to live in this package.
  --import runs a user module first; models.register adds a classifier; a dotted name is a
  user experiment module."""
  from mfopt import models
  monkeypatch.setattr(models, "MODELS", dict(models.MODELS))
  monkeypatch.setattr(models, "_REGISTERED_CLASSIFIERS", [])
  monkeypatch.syspath_prepend(str(tmp_path))
  (tmp_path / "my_models_s24.py").write_text(
      "from mfopt import models\n"
      "models.register('tiny_s24', lambda num_classes, **kw: models.MLP(hidden=(4,), "
      "num_classes=num_classes))\n"
      "import flax.linen as nn\n"
      "class NoDtype(nn.Module):\n"
      "  num_classes: int\n"
      "  @nn.compact\n"
      "  def __call__(self, x, train=False):\n"
      "    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))\n"
      "models.register('nodtype_s24', NoDtype)\n")
  (tmp_path / "my_pkg_s24").mkdir()
  (tmp_path / "my_pkg_s24" / "__init__.py").write_text("")
  (tmp_path / "my_pkg_s24" / "exp.py").write_text(
      "import ml_collections\n"
      "def get_config(quick=False):\n"
      "  c = ml_collections.ConfigDict(); c.every = 2; return c\n"
      "def validate(c):\n"
      "  if c.every < 1: raise ValueError(f\"'every' must be positive, got {c.every}\")\n"
      "def run(c, workdir):\n"
      "  (workdir / 'report.md').write_text(f'every {c.every}\\n'); return {'every': c.every}\n")
  _raises(r"'model' must be one of .*got 'tiny_s24'", "hybrid_vs_baselines", "model=tiny_s24")
  assert runner.main(["--import", "my_models_s24", "--show-config", "hybrid_vs_baselines",
                      "--quick", "model=tiny_s24"]) == 0
  assert "model: tiny_s24" in capsys.readouterr().out
  assert models.classifiers()[-2:] == ("tiny_s24", "nodtype_s24")
  _, c = runner.prepare("block_momentum_table", quick=True,
                        overrides=["pairs=(('digits','tiny_s24'),)"])
  with pytest.raises(ValueError, match=r"model name 'tiny_s24' is taken"):
    models.register("tiny_s24", models.MLP)
  # the seed-004 experiments set the compute dtype: a model without the field is refused
  # before the run (it stopped with a traceback after making the workdir)
  _raises(r"'model': 'nodtype_s24' \(registered\) has no 'dtype' field", "hybrid_vs_baselines",
          "model=nodtype_s24")
  capsys.readouterr()
  assert runner.main(["--help", "my_pkg_s24.exp"]) == 0
  assert "None" not in capsys.readouterr().out  # (no docstrings: it printed "None" twice)
  assert runner.main(["my_pkg_s24.exp", "--workdir", str(tmp_path / "w"), "every=3"]) == 0
  assert (tmp_path / "w" / "report.md").read_text() == "every 3\n"
  assert runner.main(["my_pkg_s24.exp", "--workdir", str(tmp_path / "w2"), "every=0"]) == 2
  assert "'every' must be positive, got 0" in capsys.readouterr().err
  (tmp_path / "my_pkg_s24" / "dictcfg.py").write_text(
      "def get_config(quick=False):\n  return {'lr': 0.1}\n"
      "def run(c, workdir):\n  return {}\n")
  assert runner.main(["my_pkg_s24.dictcfg", "--workdir", str(tmp_path / "w3")]) == 2
  assert ("get_config must return an ml_collections.ConfigDict, got dict"
          in capsys.readouterr().err)  # (a traceback from inside the override parser)
  assert runner.main(["--import", "no_such_module_s24", "quickstart"]) == 2
  assert "--import no_such_module_s24" in capsys.readouterr().err


def test_tuple_of_strings_in_parentheses_without_quotes():
  _, c = runner.prepare("precision", quick=True, overrides=["policies=(fp32,bf16)"])
  assert c.policies == ("fp32", "bf16")


def test_override_applies_with_type():
  _, c = runner.prepare("quickstart", quick=True, overrides=["num_steps=7", "datasets=digits",
                                                             "models=('mlp',)"])
  assert c.num_steps == 7 and c.datasets == ("digits",) and c.models == ("mlp",)


def test_quickstart_pair_named_twice_is_refused():
  _raises(r"name the same \(dataset, model\) pair twice: "
          r"\[\('digits', 'mlp'\), \('digits', 'mlp'\)\]",
          "quickstart", "datasets=('digits','digits')", "models=('mlp','mlp')")


def test_quickstart_one_dataset_two_models_keeps_both(tmp_path):
  """A dataset named twice (two models) used to share one curve panel and one log identity: the
  second model's rows overwrote the first's curves, and metrics.jsonl could not tell them apart."""
  runner.run_experiment("quickstart", quick=True, workdir=tmp_path, overrides=[
      "datasets=('digits','digits')", "models=('mlp','cnn')", "num_steps=4", "log_every=2",
      "progress=false", "algorithms=('sync Adam (optax)',)", "sim_runs=()"])
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert sorted((l["model"], l["step"]) for l in lines) == [
      ("cnn", 2), ("cnn", 4), ("mlp", 2), ("mlp", 4)]
  report = (tmp_path / "report.md").read_text()
  assert "| digits | mlp | sync Adam (optax)" in report and "| digits | cnn | sync Adam" in report


def test_workers_that_do_not_split_the_batch_fail_before_compiling(tmp_path):
  # (12 workers on 8 fake devices now run, on mfopt.parallel.worker_mesh(12): 6 devices x 2,
  # as in every other experiment; a global batch they do not split still fails first.)
  with pytest.raises(ValueError, match="global_batch must be divisible by num_workers=12.*100"):
    runner.run_experiment("quickstart", quick=True, workdir=tmp_path,
                          overrides=["num_workers=12", "global_batch=100", "progress=false"])
  assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_reports_config_errors_with_exit_code_2():
  out = subprocess.run([sys.executable, "-m", "experiments", "quickstart", "--quick", "bogus=1"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  assert "unknown config key 'bogus'" in out.stderr


def test_quickstart_quick_both_datasets_report_learn_and_plot(tmp_path):
  """The main job's default pairs (digits/MLP, mnist1d/CNN) in one run, three algorithms (one
  per kind of exchange) and a simulated row: both datasets' rows, their collectives, report
  lines and curves (every algorithm: the next test, on digits/MLP; the mnist1d/CNN half of all
  18 rows took 54 s of 94, cold cache, on the 2-core VM)."""
  algos = ("sync SGD m=0.9 (optax)", "CPSGD p=8 (local SGD m=0.9)", "QSGD 8-bit (SGD m=0.9)")
  summary = runner.run_experiment(
      "quickstart", quick=True, workdir=tmp_path,
      overrides=["progress=false", "num_steps=20", "log_every=10", f"algorithms={algos!r}",
                 "sim_runs=('BSP parameter server (simulated)',)"])
  report = (tmp_path / "report.md").read_text()
  assert "1,437 train / 360 test" in report and "4,000 train / 1,000 test" in report
  rows = summary["rows"]
  assert sorted((r["dataset"], r["model"]) for r in rows) == sorted(
      [(d, m) for d, m in (("digits", "mlp"), ("mnist1d", "cnn")) for _ in range(4)])
  for r in rows:
    assert r["samples"] == 20 * 128
    assert r["test_accuracy"] > 0.15  # chance is 0.1 on both (measured 0.28-0.32 on mnist1d)
    # the collectives, on the CNN's conv kernels too: every step, every 8 steps, all-gathers
    want = {"sync": (20, 0), "CPSG": (2, 0), "QSGD": (0, 20)}.get(r["algorithm"][:4])
    if want is not None:
      assert (r["all_reduces"], r.get("all_gathers", 0)) == want, r
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert sorted((l["dataset"], l["step"]) for l in lines if l["algorithm"] in algos) == sorted(
      [(d, s) for d in ("digits", "mnist1d") for s in (10, 20) for _ in algos])
  assert (tmp_path / "loss_curves.png").stat().st_size > 0


def test_quickstart_quick_writes_report_table_and_plot(tmp_path):
  """Every algorithm of the main job, on digits/MLP (the other pair: the test above)."""
  summary = runner.run_experiment("quickstart", quick=True, workdir=tmp_path,
                                  overrides=["progress=false", "num_steps=20", "log_every=10",
                                             "datasets=digits", "models=mlp"])
  for name in ("config.json", "summary.json", "metrics.jsonl", "report.md", "loss_curves.png"):
    assert (tmp_path / name).stat().st_size > 0, name
  report = (tmp_path / "report.md").read_text()
  assert "Device:" in report and "Workers: 8" in report
  assert "1,437 train / 360 test" in report
  rows = summary["rows"]
  assert {r["dataset"] for r in rows} == {"digits"}
  from experiments.quickstart import ALGORITHMS, SIM_RUNS
  assert {r["algorithm"] for r in rows} == set(ALGORITHMS) | set(SIM_RUNS)  # every algorithm
  for r in rows:
    assert r["samples"] == 20 * 128  # equal samples processed, simulated rows included
    assert 0.0 <= r["test_accuracy"] <= 1.0
    if r["algorithm"].startswith("sync "):
      # Synchronous algorithms: one all-reduce of the whole gradient per step.
      assert r["all_reduces"] == 20
      assert r["payload_bytes"] % 20 == 0 and r["payload_bytes"] > 0
    elif "p=8" in r["algorithm"] or "K=8" in r["algorithm"]:
      # Period 8 over 20 steps: floor(20/8) = 2 parameter exchanges, nothing on local steps.
      assert r["all_reduces"] == 2
  sync = next(r for r in rows if r["algorithm"] == "sync SGD m=0.9 (optax)"
              and r["dataset"] == "digits")
  cpsgd = next(r for r in rows if r["algorithm"].startswith("CPSGD") and r["dataset"] == "digits")
  assert cpsgd["payload_bytes"] * 10 == sync["payload_bytes"]  # same payload, 2 vs 20 exchanges
  # QSGD: one all-gather per step of n int8 levels + a float32 norm per 512 values
  q = next(r for r in rows if r["algorithm"].startswith("QSGD") and r["dataset"] == "digits")
  n = sync["payload_bytes"] // 20 // 4  # float32 parameters
  assert q["all_gathers"] == q["collectives"] == 20 and q["all_reduces"] == 0
  assert q["payload_bytes"] == 20 * (n + 4 * -(-n // 512))
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  fit_rows = [r for r in rows if "sim_time_s" not in r]
  assert sum(1 for l in lines if l["algorithm"] in ALGORITHMS) == 2 * len(fit_rows)  # steps 10, 20
  # Learning progressed: SGD beats chance on digits after 20 steps.
  sgd = [r for r in rows if r["dataset"] == "digits" and "SGD m=0.9" in r["algorithm"]][0]
  assert sgd["test_accuracy"] > 0.3
  # Another config into the same workdir is refused before anything runs: with checkpoints,
  # and without (a run interrupted before its first save, or simulator rows), whose
  # metrics.jsonl rows would otherwise mix with the new config's.
  other = ["progress=false", "num_steps=10", "log_every=10", "datasets=digits", "models=mlp"]
  with pytest.raises(runner.ConfigError, match=r"holds checkpoints of a different .*num_steps"):
    runner.run_experiment("quickstart", quick=True, workdir=tmp_path, overrides=other)
  shutil.rmtree(tmp_path / "checkpoints")
  with pytest.raises(runner.ConfigError, match=r"holds results of a different .*num_steps: 20 -> 10"):
    runner.run_experiment("quickstart", quick=True, workdir=tmp_path, overrides=other)
  assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(lines)


def test_restart_discards_checkpoints_the_data_log_and_the_runs_outputs(tmp_path):
  """--restart leaves the folder to the new run: a discarded run's per-seed trace of a seed the
  new run does not have used to stay beside its report. A user's files from before the run or
  after it ended stay (those after it went too)."""
  import os
  import time
  began = time.time() - 100
  for d in (tmp_path, tmp_path / "process-1"):
    (d / "checkpoints" / "000-run").mkdir(parents=True)
    for name in ("config.json", "summary.json", "metrics.jsonl", "report.md",
                 "trace_CPSGD_seed1.json", "loss.png", "notes.txt", "mine.json"):
      (d / name).write_text("{}")
    (d / "attempts.json").write_text(json.dumps([{"started": began}, {"started": began + 50}]))
    for f in d.iterdir():
      if f.is_file():
        os.utime(f, (began + 60, began + 60))  # the run wrote these; it ended at began + 60
    os.utime(d / "mine.json", (began - 60, began - 60))  # there before the run
    (d / "later.md").write_text("notes written after the run ended")  # (mtime: now)
  removed = runner.discard_run_data(tmp_path)
  assert not (tmp_path / "checkpoints").exists()
  for d in (tmp_path, tmp_path / "process-1"):
    assert sorted(f.name for f in d.iterdir() if f.is_file()) == ["later.md", "mine.json",
                                                                  "notes.txt"]
  assert sorted(str(f.relative_to(tmp_path)) for f in removed) == sorted(
      ["checkpoints"] + [p + n for p in ("", "process-1/") for n in (
          "report.md", "trace_CPSGD_seed1.json", "loss.png", "config.json", "summary.json",
          "metrics.jsonl", "attempts.json")])
  assert runner.check_resumable(tmp_path, {"experiment": "x"}) is False


def test_restart_lists_only_what_was_there(tmp_path):
  """discard_run_data returns the paths it removed, and the CLI prints them: a run that got as
  far as its first checkpoint and config has no summary, data log or attempts file to list."""
  (tmp_path / "checkpoints" / "000-run").mkdir(parents=True)
  (tmp_path / "config.json").write_text("{}")
  removed = runner.discard_run_data(tmp_path)
  assert sorted(str(f.relative_to(tmp_path)) for f in removed) == ["checkpoints", "config.json"]
  assert list(tmp_path.iterdir()) == []


def test_restart_also_removes_outputs_of_the_first_of_several_attempts(tmp_path):
  """The discarded run began with its first attempt: a plot the first attempt wrote before it
  was killed is that run's output too (dating the run from its last attempt left it behind);
  a file from before the first attempt stays."""
  import os
  import time
  began = time.time() - 100
  (tmp_path / "attempts.json").write_text(json.dumps([{"started": began},
                                                      {"started": began + 50}]))
  for name, mtime in (("loss.png", began + 20), ("mine.md", began - 60),
                      ("attempts.json", began + 60)):
    if not (tmp_path / name).exists():
      (tmp_path / name).write_text("{}")
    os.utime(tmp_path / name, (mtime, mtime))
  removed = runner.discard_run_data(tmp_path)
  assert sorted(f.name for f in removed) == ["attempts.json", "loss.png"]
  assert [f.name for f in tmp_path.iterdir()] == ["mine.md"]


def test_results_of_another_config_without_checkpoints_are_refused_not_deleted(tmp_path):
  """An interrupted run that logged metrics rows but saved no checkpoint (a simulator run)
  still holds results: a rerun with another config is refused and the rows stay (only a
  workdir with no results at all is taken over afresh)."""
  saved = {"experiment": "x", "quick": True, "config": {"seed": 0}}
  (tmp_path / "config.json").write_text(json.dumps(saved))
  (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
  other = {**saved, "config": {"seed": 1}}
  with pytest.raises(runner.ConfigError, match=r"holds results of a different experiment or "
                     r"config; differing fields \(saved -> now\): config.seed: 0 -> 1\."):
    runner.check_resumable(tmp_path, other)
  assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json", "metrics.jsonl"]
  (tmp_path / "metrics.jsonl").unlink()  # no results: the corrected command may start afresh
  assert runner.check_resumable(tmp_path, other) is False
  assert list(tmp_path.iterdir()) == []


def test_an_empty_checkpoint_folder_is_nothing_to_resume(tmp_path):
  """A checkpoints folder without a checkpoint in it (the run was killed before its first
  save) means the run starts over: not reported as resumed, and not refused as holding
  checkpoints of another config."""
  record = {"experiment": "x", "quick": True, "config": {"seed": 0}}
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "config.json").write_text(json.dumps(record))
  assert runner.check_resumable(tmp_path, record) is False
  assert runner.check_resumable(tmp_path, {**record, "config": {"seed": 1}}) is False


def test_worker_counts_that_do_not_split_over_the_processes_are_named(monkeypatch):
  import jax
  import ml_collections
  c = ml_collections.ConfigDict({"workers": (1, 2, 3, 8), "num_workers": 6, "nested": {"w": 4}})
  runner.require_process_multiple(c, "workers", "num_workers", "nested.w")  # one process: any
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  runner.require_process_multiple(c, "num_workers", "nested.w")
  with pytest.raises(runner.ConfigError, match=(
      r"config field 'workers': worker counts \[1, 3\] are not multiples of the 2 processes .*"
      r"pass workers=\(2, 8\)$")):
    runner.require_process_multiple(c, "workers")
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  with pytest.raises(runner.ConfigError, match=r"'num_workers': worker counts \[6\] .*use multiples of 4$"):
    runner.require_process_multiple(c, "num_workers")
  c.workers = (1, 3)
  with pytest.raises(runner.ConfigError, match=r"'workers'.*\[1, 3\] .*use multiples of 4$"):
    runner.require_process_multiple(c, "workers")


def test_a_dataset_not_prepared_is_an_error_line_and_leaves_the_workdir_usable(
    tmp_path, monkeypatch, capsys):
  """A TFDS dataset missing from the data dir printed a traceback; the failed attempt's
  config.json then refused the corrected command ("holds results of a different config"),
  though nothing had been logged."""
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "no_tfds"))
  work = tmp_path / "w"
  args = ["mf_mlp", "--quick", "--workdir", str(work)]
  assert runner.main(args + ["dataset=mnist"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and "mnist" in err and "Traceback" not in err
  assert (work / "config.json").exists() and not (work / "metrics.jsonl").exists()
  assert runner.main(args + ["epochs=0.1"]) == 0, capsys.readouterr().err
  assert "holds no results of its earlier config" in capsys.readouterr().err
  assert len(json.loads((work / runner.ATTEMPTS).read_text())) == 1  # the failed one discarded


def test_dataset_registered_after_the_experiment_was_imported_is_accepted(monkeypatch):
  """An experiment's CHOICES used to be computed at import: a dataset a user registered
  afterwards (mfopt.data.register) was refused as an unknown name."""
  from mfopt import data
  runner.load_experiment("adpsgd_variance")  # imported (and its CHOICES built) first
  monkeypatch.setitem(data._LOADERS, "my_digits", data._LOADERS["digits"])
  _, c = runner.prepare("adpsgd_variance", quick=True, overrides=["dataset=my_digits"])
  assert c.dataset == "my_digits"
  _raises(r"'dataset' must be one of \[.*'my_digits'.*got 'textcorpus'", "adpsgd_variance",
          "dataset=textcorpus")


def test_restart_on_the_command_line_says_what_it_removed(tmp_path, capsys):
  quick = ["quickstart", "--quick", "--workdir", str(tmp_path), "datasets=digits", "models=mlp",
           "num_steps=2", "log_every=2", "progress=false", "sim_runs=()",
           "algorithms=('sync Adam (optax)',)"]
  assert runner.main(quick) == 0
  capsys.readouterr()
  assert runner.main([*quick, "--restart"]) == 0
  err = capsys.readouterr().err
  assert re.search(r"--restart removed the discarded run's checkpoints, data log and outputs: "
                   r"(?=.*checkpoints)(?=.*metrics\.jsonl)(?=.*attempts\.json).*report\.md",
                   err), err
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["attempts"] == 1 and not summary["resumed"]  # a fresh run


def test_help_with_a_name_describes_that_experiment(capsys):
  """``NAME --help`` printed the same help for every name (and 0 for an unknown one); with no
  name the list came with exit status 2 and no word of why."""
  assert runner.main(["adpsgd_variance", "--help", "--quick"]) == 0
  out = capsys.readouterr().out
  assert "adpsgd_variance: seed 001 Fig. 1" in out and "Command: ``python -m experiments" in out
  assert "config (--quick) (override with key=value):" in out and "p_init: 4" in out
  assert runner.main(["nope", "--help"]) == 2
  assert "unknown experiment 'nope'" in capsys.readouterr().err
  assert runner.main([]) == 2
  assert "error: name an experiment" in capsys.readouterr().err


@pytest.mark.parametrize("text,want", [("true", True), ("1", True), ("YES", True),
                                       ("false", False), ("0", False), ("no", False)])
def test_bool_overrides(text, want):
  assert runner._parse_value("progress", text, True) is want
  assert runner._parse_value("progress", text, False) is want


def test_bool_override_refuses_other_words():
  with pytest.raises(runner.ConfigError, match="progress"):
    runner._parse_value("progress", "maybe", True)


class _Loaded(Exception):
  pass


@pytest.mark.parametrize("name", ["mf_mlp", "mf_sweep", "mf_batch_workers", "hybrid_vs_baselines",
                                  "hybrid_warmup_T", "precision", "bn_strategies"])
def test_num_train_reaches_a_generated_dataset_and_is_refused_for_fixed_splits(name, monkeypatch,
                                                                               tmp_path):
  """dataset=digits num_train=500 trained on all 1,437 digits and said nothing (the sizes went
  to mnist1d only; synthetic, which takes them too, used its loader's defaults: the next test).
  Every experiment with the two fields passes them through data.load_sized."""
  for order in (("dataset=digits", "num_train=500"), ("num_test=50", "dataset=digits")):
    key = order[0 if order[0].startswith("num") else 1].split("=")[0]
    _raises(rf"'{key}' sets the size of a generated dataset \(mnist1d, synthetic\); "
            r"dataset='digits' has fixed splits", name, *order)
  module, c = runner.prepare(name, quick=True,
                             overrides=["dataset=mnist1d", "num_train=300", "num_test=70"])
  calls = []

  def load_sized(*args):
    calls.append(args)
    raise _Loaded

  monkeypatch.setattr(data, "load_sized", load_sized)
  with pytest.raises(_Loaded):
    module.run(c, tmp_path)
  assert calls == [("mnist1d", 300, 70)]


def test_load_sized_passes_sizes_only_to_loaders_that_take_them():
  assert data.takes_sizes("mnist1d") and data.takes_sizes("synthetic")
  assert not data.takes_sizes("digits") and not data.takes_sizes("cifar10")
  with pytest.raises(ValueError, match="unknown dataset name 'nope'"):
    data.takes_sizes("nope")
  ds = data.load_sized("synthetic", 300, 70)
  assert (len(ds.train), len(ds.test)) == (300, 70)
  ds = data.load_sized("digits", 300, 70)  # fixed splits, whole
  assert (len(ds.train), len(ds.test)) == (1437, 360)


def test_quickstart_report_columns_and_labels(tmp_path):
  """quickstart's report from hand-built rows (no training): each number sits under its own
  header (test accuracy, train loss, exchanges, bytes), the BN setting and steps are stated as
  configured, and a dataset named once is labelled by itself, twice by dataset/model."""
  from experiments import quickstart
  _, c = runner.prepare("quickstart", quick=True, overrides=["datasets=digits", "models=mlp",
                                                             "algorithms=('sync Adam (optax)',)",
                                                             "sim_runs=()", "num_steps=7"])
  row = {"dataset": "digits", "model": "mlp", "algorithm": "sync Adam (optax)", "peak_lr": 0.001,
         "test_accuracy": 0.875, "final_train_loss": 0.25, "collectives": 7,
         "payload_bytes": 700, "train_s": 1.5}
  quickstart._write_report(c, tmp_path, [row], {"digits": {"train": 1437, "test": 360}})
  text = (tmp_path / "report.md").read_text()
  header = next(line for line in text.splitlines() if line.startswith("| dataset |"))
  cells = next(line for line in text.splitlines() if line.startswith("| digits |"))
  table = dict(zip([h.strip() for h in header.strip("|").split("|")],
                   [v.strip() for v in cells.strip("|").split("|")]))
  assert float(table["test acc"]) == 0.875 and float(table["final train loss"]) == 0.25
  assert table["exchanges/worker"] == "7" and table["bytes sent/worker"] == "700"
  assert "(BatchNorm off)" in text and "- Steps: 7 per run for every algorithm" in text
  assert quickstart._label(c, "digits", "mlp") == "digits"
  c.datasets, c.models = ("digits", "digits"), ("mlp", "cnn")
  assert quickstart._label(c, "digits", "cnn") == "digits/cnn"


def test_plot_curves_labels_each_panel_and_draws_identical_series_once(tmp_path, monkeypatch):
  """Per-panel x labels (ksync_trace's two panels read "server step | simulated time (s)"
  under both), and series with exactly the same points drawn once with both names (BSP was
  drawn under all-reduce and looked missing)."""
  import matplotlib.pyplot as plt

  from mfopt import report
  figs = []
  monkeypatch.setattr(plt, "close", figs.append)
  same = ([0.0, 1.0, 2.0], [0.1, 0.2, 0.3])
  panels = {"a": {"BSP": same, "all-reduce": same, "ASP": ([0.0, 1.0, 2.0], [0.1, 0.2, 0.4])},
            "b": {"BSP": ([0.0, 1.0], [0.1, 0.2])}}
  report.plot_curves(tmp_path / "p.png", panels, xlabel=("step", "time (s)"), ylabel="acc",
                     title="t (simulated)")
  ax_a, ax_b = figs[0].axes
  assert (ax_a.get_xlabel(), ax_b.get_xlabel()) == ("step", "time (s)")
  assert [line.get_label() for line in ax_a.lines] == ["BSP = all-reduce", "ASP"]
  assert (tmp_path / "p.png").stat().st_size > 0
  with pytest.raises(ValueError, match=r"one per panel \(2\), got \('step',\)"):
    report.plot_curves(tmp_path / "q.png", panels, xlabel=("step",), ylabel="acc")
  # one label for all panels, as before
  report.plot_curves(tmp_path / "r.png", panels, xlabel="step", ylabel="acc")
  assert [ax.get_xlabel() for ax in figs[-1].axes] == ["step", "step"]
  with pytest.raises(ValueError, match=r"one per panel \(2\)"):  # one too many
    report.plot_curves(tmp_path / "s.png", panels, xlabel=("a", "b", "c"), ylabel="acc")
  # only exactly the same points merge: same y at other x, or other y at the same x, do not
  series = {"z": ([0.0, 1.0], [0.5, 0.6]), "later": ([1.0, 2.0], [0.5, 0.6]),
            "a": ([0.0, 1.0], [0.5, 0.7]), "y": ([0.0, 1.0], [0.5, 0.6])}
  merged = report.merge_identical_series(series)
  assert list(merged) == ["z = y", "later", "a"]  # first-seen order, names as given
  assert merged["later"] == series["later"] and merged["z = y"] == series["z"]
