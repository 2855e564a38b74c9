"""Datasets and deterministic per-worker batching.

Three pieces:

* **Sources.** A *source* (:class:`Source`) is anything with ``__len__`` and
  ``get(indices, rng) -> {"x": ..., "y": ...}``: random access to examples by
  index, with training augmentation drawn from ``rng`` when one is given and no
  augmentation when ``rng is None`` (evaluation). :class:`ArraySource` holds
  in-memory NumPy arrays; :class:`TFDSSource` reads a prepared TFDS dataset
  through ``tfds.data_source`` (ArrayRecord random access, no TensorFlow).
* **Datasets.** :func:`load` builds a :class:`Dataset` (a train and a test
  source plus shapes and JSON-serialisable ``meta``) by name from a registry.
  ``digits``, ``mnist1d``, ``synthetic`` and ``textcorpus`` ship offline;
  ``mnist``, ``cifar10``, ``cifar100``, ``imagenet2012`` and ``tiny_shakespeare``
  need a prepared TFDS data dir.
* **Batching.** :class:`WorkerBatcher` gives every worker its own
  deterministic stream. ``batcher.batch(step)`` is a pure function of
  ``(seed, step)``: a run resumes exactly from a step number, and at equal global
  batch every worker count processes the same examples with the same
  augmentation. ``batcher.batch(step, workers)`` is those workers' rows of it (a
  process of a multi-process run reads only its own). :func:`eval_batches` walks a
  whole source in fixed order, or one process's share of its batches.

Example:

>>> from mfopt.data import WorkerBatcher, load
>>> ds = load("digits")
>>> batcher = WorkerBatcher(ds.train, num_workers=4, per_worker_batch=8, seed=0)
>>> batch = batcher.batch(0)
>>> batch["x"].shape, batch["y"].shape
((4, 8, 8, 8, 1), (4, 8))

This module's own code uses NumPy only (plus scikit-learn, mnist1d, TFDS and PIL,
each imported when a dataset needs it; JAX comes in only through the ``mfopt``
package's argument checks); it never imports TensorFlow.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import pathlib
import random
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mfopt import _checks

Batch = dict[str, np.ndarray]
Augment = Callable[[np.ndarray, np.random.Generator], np.ndarray]
Preprocess = Callable[[Mapping[str, Any], "np.random.Generator | None"], Batch]

TASKS = ("classification", "language_model")


# ------------------------------------------------------------------------------
# Sources.
# ------------------------------------------------------------------------------


@runtime_checkable
class Source(Protocol):
  """Random access to the examples of one split.

  ``get(indices, rng)`` returns ``{"x": ..., "y": ...}`` with a leading axis of
  ``len(indices)``, in the order of ``indices``. With a generator ``rng`` it
  applies training augmentation drawn from it; with ``rng=None`` (evaluation)
  the result is a deterministic function of ``indices``.

  A source with an ``augments`` attribute that is false (an :class:`ArraySource`
  without ``augment``, a :class:`TFDSSource` whose preprocessing draws nothing) is
  not given a generator. A source whose augmentation is
  drawn example by example may set
  ``per_example_rng = True`` and then also accept a sequence of generators, one
  per index (:class:`TFDSSource` does): :class:`WorkerBatcher` then reads and
  augments only the rows a process asks for, with draws that do not depend on
  which other examples are read.
  """

  def __len__(self) -> int:
    ...

  def get(self, indices: np.ndarray, rng: np.random.Generator | None) -> Batch:
    ...


class ArraySource:
  """A source over in-memory arrays, gathered with fancy indexing.

  Args:
    x: inputs, shape ``(N, *input_shape)``.
    y: targets, shape ``(N, ...)``.
    augment: optional ``augment(x_batch, rng) -> x_batch`` applied to the
      gathered inputs when :meth:`get` is given a generator.
  """

  def __init__(self, x: np.ndarray, y: np.ndarray, augment: Augment | None = None):
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 0 or y.ndim == 0:
      raise ValueError(f"x and y need a leading example axis, got shapes {x.shape} and {y.shape}")
    if len(x) != len(y):
      raise ValueError(f"x and y must hold the same number of examples, got len(x)={len(x)} "
                       f"and len(y)={len(y)}")
    self.x, self.y, self.augment = x, y, augment

  def __len__(self) -> int:
    return len(self.x)

  def get(self, indices: np.ndarray, rng: np.random.Generator | None = None) -> Batch:
    indices = np.asarray(indices)
    x = self.x[indices]
    if rng is not None and self.augment is not None:
      x = self.augment(x, rng)
    return {"x": x, "y": self.y[indices]}

  @property
  def augments(self) -> bool:
    """Whether :meth:`get` draws from its generator (``augment`` is set)."""
    return self.augment is not None

  def __repr__(self) -> str:
    return (f"ArraySource(x={self.x.dtype}{list(self.x.shape)}, y={self.y.dtype}{list(self.y.shape)}, "
            f"augment={getattr(self.augment, '__name__', self.augment)})")


class DatasetNotPreparedError(FileNotFoundError):
  """A TFDS dataset is not prepared (in a random-access format) in the data dir."""


class BatchTooLargeError(ValueError):
  """The global batch (workers x per-worker batch) is larger than the dataset."""


# How to obtain each dataset, beyond `tfds build`.
_PREPARE_HINTS = {
    "imagenet2012": ("ImageNet needs a manual download: put ILSVRC2012_img_train.tar and "
                     "ILSVRC2012_img_val.tar in {data_dir}/downloads/manual first. "),
}


def tfds_data_dir(data_dir: str | os.PathLike | None = None) -> str:
  """``data_dir`` if given, else ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``."""
  if data_dir is None:
    data_dir = os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
  return os.path.expanduser(os.fspath(data_dir))


def _not_prepared_message(name: str, data_dir: str, why: str) -> str:
  hint = _PREPARE_HINTS.get(name, "").format(data_dir=data_dir)
  return (f"TFDS dataset {name!r} {why} (data_dir={data_dir!r}, searched "
          f"{os.path.join(data_dir, name)}). {hint}To prepare it, run `tfds build {name} "
          f"--data_dir {data_dir} --file_format=array_record` on a machine with internet access "
          f"(`tfds build` needs TensorFlow: pip install tensorflow; reading it here does not), "
          f"or copy a prepared {name}/ directory (array_record format) into {data_dir}; or point "
          f"at a directory that holds one: $TFDS_DATA_DIR (the experiments), or "
          f"mfopt.data.load(..., data_dir=...) in your own code.")


def open_tfds(name: str, *, split: str, data_dir: str | os.PathLike | None = None):
  """``tfds.data_source(name, split=split, data_dir=data_dir, download=False)``.

  Never downloads. Failures to open are diagnosed: a dataset that is not
  prepared in ``data_dir``, or is prepared only as TFRecord (which has no random
  access), raises :class:`DatasetNotPreparedError` naming the dataset, the
  directory searched, and how to prepare it. (TFDS itself reports a missing
  registered dataset as ``NotImplementedError: Random access data source for
  file format FileFormat.TFRECORD is not supported``.) An unknown name raises
  TFDS's own ``DatasetNotFoundError``, which lists the known names.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  data_dir = tfds_data_dir(data_dir)
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except Exception as err:  # pylint: disable=broad-except
    try:
      builder = tfds.builder(name, data_dir=data_dir)
      prepared = builder.is_prepared()
      file_format = str(getattr(builder.info, "file_format", "") or "")
    except Exception:  # pylint: disable=broad-except
      raise err from None  # Not a TFDS name (TFDS lists the known ones), or worse.
    if not prepared:
      raise DatasetNotPreparedError(_not_prepared_message(name, data_dir, "is not prepared")) from err
    if "TFRECORD" in file_format.upper():
      raise DatasetNotPreparedError(_not_prepared_message(
          name, data_dir, "is prepared only as TFRecord, which has no random access")) from err
    raise


def default_data_threads(decode_heavy: bool = False) -> int:
  """Threads a :class:`TFDSSource` reads on by default.

  ``$MFOPT_DATA_THREADS`` when set (for every TFDS source); otherwise
  ``min(16, os.cpu_count())`` for sources whose per-example work is mostly a large
  image decode that releases the GIL (``decode_heavy``: ImageNet), and 1 for the
  rest, where threads measured slower (BENCHMARKS.md, "Input pipeline").
  """
  env = os.environ.get("MFOPT_DATA_THREADS")
  if env:
    try:
      value = int(env)
    except ValueError:
      raise ValueError(f"MFOPT_DATA_THREADS must be a positive integer, got {env!r}") from None
    return _checks.positive_int("MFOPT_DATA_THREADS", value)
  return min(16, os.cpu_count() or 1) if decode_heavy else 1


class TFDSSource:
  """A source reading one split of a prepared TFDS dataset, one example at a time.

  Built on ``tfds.data_source`` (random access over ArrayRecord files; works
  without TensorFlow). Each example (a dict of NumPy values as TFDS decodes it)
  goes through ``preprocess(example, rng) -> {"x": ..., "y": ...}``, with
  ``rng=None`` at evaluation; the per-example results are stacked. Examples are
  read one by one with ``__getitem__`` (``tfds.testing.mock_data`` does not
  support the batched ``__getitems__``).

  ``get(indices, rng)`` takes one generator, drawn from example after example,
  or (``per_example_rng``) a sequence of generators, one per index, so that
  :class:`WorkerBatcher` can give each example of a step its own stream and
  read only a process's own workers' examples.

  Reading, decoding and preprocessing can run on ``num_threads`` threads whenever no
  generator is shared between examples (evaluation, and :class:`WorkerBatcher`'s
  per-example streams), so the result does not depend on the thread count; with one
  shared generator they run in order. Threads pay only where the per-example work
  releases the GIL: decoding a
  large JPEG does (ImageNet, whose loader defaults to ``min(16, CPUs)`` threads), while
  a 32 x 32 CIFAR image is mostly Python bookkeeping, where two threads read at about
  half the rate of one (BENCHMARKS.md, "Input pipeline"); hence the default of 1
  thread. This is a thread pool, not a data-loading library: ``grain``
  (multi-process workers over the same ArrayRecord sources) is the tool when Python
  preprocessing still limits.

  Args:
    name: TFDS name, e.g. ``"cifar10"``.
    split: TFDS split, e.g. ``"train"``.
    preprocess: per-example ``preprocess(example, rng)``.
    data_dir: TFDS data dir; see :func:`tfds_data_dir`.
    num_threads: threads per :meth:`get`; default ``MFOPT_DATA_THREADS`` if set,
      else 1 (see :func:`default_data_threads`). 1 reads in the calling thread. May
      be changed later (``source.num_threads = 8``).
    augments: whether ``preprocess`` draws from its generator; ``False`` (MNIST,
      CIFAR with ``augment=False``) spares :class:`WorkerBatcher` from building a
      generator per example that would go unused.
  """

  per_example_rng = True

  def __init__(self, name: str, *, split: str, preprocess: Preprocess,
               data_dir: str | os.PathLike | None = None, num_threads: int | None = None,
               augments: bool = True):
    self.name, self.split, self.preprocess = name, split, preprocess
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._num_threads = 1
    self.num_threads = default_data_threads() if num_threads is None else num_threads
    self.augments = bool(augments)
    self.data_dir = tfds_data_dir(data_dir)
    self._source = open_tfds(name, split=split, data_dir=self.data_dir)

  @property
  def num_threads(self) -> int:
    return self._num_threads

  @num_threads.setter
  def num_threads(self, value: int) -> None:
    value = _checks.positive_int("num_threads", value)
    if value != self._num_threads and self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None
    self._num_threads = value

  def __len__(self) -> int:
    return len(self._source)

  def _map(self, fn: Callable[..., Any], *items: Sequence[Any]) -> list[Any]:
    """``[fn(*args) for args in zip(*items)]``, one pool task per example.

    One task per example balances examples of unequal cost (ImageNet's photos vary
    in size). One contiguous chunk per thread was measured too (BENCHMARKS.md, "Input
    pipeline", session 13): within the run-to-run spread on the ImageNet stand-in, and
    on CIFAR, which reads on 1 thread by default, still about half the 1-thread rate.
    """
    if self.num_threads == 1 or len(items[0]) < 2:
      return [fn(*args) for args in zip(*items)]
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.num_threads,
                                                         thread_name_prefix="mfopt-tfds")
    return list(self._pool.map(fn, *items))

  def get(self, indices: np.ndarray,
          rng: np.random.Generator | Sequence[np.random.Generator] | None = None) -> Batch:
    indices = np.asarray(indices).reshape(-1)
    if indices.size == 0:
      raise ValueError(f"indices must be non-empty, got {indices!r}")
    if rng is None or isinstance(rng, np.random.Generator):
      rngs = [rng] * indices.size
    else:
      rngs = list(rng)
      if len(rngs) != indices.size:
        raise ValueError(f"rng: {len(rngs)} generators for {indices.size} indices; give one "
                         "generator, one per index, or None")
    def one(i, r):
      return self.preprocess(self._source[int(i)], r)

    if isinstance(rng, np.random.Generator):  # one stream drawn example after example
      examples = [one(i, r) for i, r in zip(indices, rngs)]
    else:
      examples = self._map(one, indices, rngs)
    return {k: np.stack([ex[k] for ex in examples]) for k in examples[0]}

  def __repr__(self) -> str:
    return f"TFDSSource({self.name!r}, split={self.split!r}, data_dir={self.data_dir!r})"


# ------------------------------------------------------------------------------
# Datasets and the registry.
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A train and a test source with what a model and a report need to know.

  Attributes:
    name: registry name.
    train: training source.
    test: test (or validation) source.
    num_classes: number of classes; the vocabulary size for a language model.
    input_shape: shape of one example's ``x``, e.g. ``(40, 1)`` for mnist1d,
      ``(8, 8, 1)`` for digits, ``(32, 32, 3)`` for CIFAR, ``(seq_len,)`` for text.
    task: ``"classification"`` or ``"language_model"`` (``y`` is then the next
      token at every position, shape ``(seq_len,)``).
    meta: JSON-serialisable facts for reports: sizes, description, source.
  """

  name: str
  train: Source
  test: Source
  num_classes: int
  input_shape: tuple[int, ...]
  task: str = "classification"
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")


_LOADERS: dict[str, Callable[..., Dataset]] = {}


TASKS = ("classification", "language_model")
_TASKS: dict[str, str] = {}


def register(name: str, task: str = "classification"
             ) -> Callable[[Callable[..., Dataset]], Callable[..., Dataset]]:
  """Decorator adding ``loader(**kwargs) -> Dataset`` to the :func:`load` registry.

  ``task``: what its ``y`` is (:data:`TASKS`): class labels, or the next token of a corpus
  (``"language_model"``); it puts the name in :func:`classification_datasets` or
  :func:`language_model_datasets`, the experiments' choices. (They were fixed name lists: a
  user's registered corpus was offered to the classification experiments and refused by the
  language-model one.)
  """
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")

  def decorator(loader: Callable[..., Dataset]) -> Callable[..., Dataset]:
    if name in _LOADERS:
      raise ValueError(f"dataset name {name!r} is already registered")
    _LOADERS[name] = loader
    _TASKS[name] = task
    return loader

  return decorator


def registered() -> tuple[str, ...]:
  """The names :func:`load` knows, sorted."""
  return tuple(sorted(_LOADERS))


#: The built-in token corpora (``task="language_model"``: ``y`` is the next token);
#: :func:`language_model_datasets` adds those a user registers.
LANGUAGE_MODEL_DATASETS = ("textcorpus", "tiny_shakespeare")


def classification_datasets() -> tuple[str, ...]:
  """The registered datasets with class labels (``register(name)``'s default task)."""
  return tuple(n for n in registered() if _TASKS.get(n, "classification") == "classification")


def language_model_datasets() -> tuple[str, ...]:
  """The registered token corpora (``register(name, task="language_model")``)."""
  return tuple(n for n in registered() if _TASKS.get(n) == "language_model")


def load(name: str, **kwargs: Any) -> Dataset:
  """Builds the dataset registered as ``name``, passing ``kwargs`` to its loader.

  Args:
    name: one of :func:`registered`: ``cifar10``, ``cifar100``, ``digits``,
      ``imagenet2012``, ``mnist``, ``mnist1d``, ``synthetic``, ``textcorpus``,
      ``tiny_shakespeare``.
    **kwargs: loader options (see the loader functions of the same name in
      this module, e.g. :func:`load_mnist1d`).

  Returns:
    A :class:`Dataset`.
  """
  try:
    loader = _LOADERS[name]
  except (KeyError, TypeError):
    raise ValueError(f"unknown dataset name {name!r}; known names: {', '.join(registered())}") from None
  return loader(**kwargs)


def takes_sizes(name: str) -> bool:
  """Whether the loader registered as ``name`` takes ``num_train`` and ``num_test`` (generated
  datasets: ``mnist1d``, ``synthetic``); one with fixed splits (``digits``, the TFDS datasets)
  does not. Raises ValueError for an unknown name, as :func:`load` does."""
  if name not in _LOADERS:
    load(name)  # raises the unknown-name error
  params = inspect.signature(_LOADERS[name]).parameters
  return "num_train" in params and "num_test" in params


def load_sized(name: str, num_train: int, num_test: int, **kwargs: Any) -> Dataset:
  """:func:`load` with ``num_train`` and ``num_test`` passed when the loader takes them
  (:func:`takes_sizes`); a dataset with fixed splits is loaded whole. The experiments' configs
  carry both sizes for every dataset; ``runner.prepare`` refuses an explicit size for a dataset
  that cannot honour it, so the sizes are never dropped silently."""
  if takes_sizes(name):
    kwargs = {"num_train": num_train, "num_test": num_test, **kwargs}
  return load(name, **kwargs)


def cache_dir() -> pathlib.Path:
  """``$MFOPT_CACHE`` if set, else ``~/.cache/mfopt`` (not created here)."""
  return pathlib.Path(os.environ.get("MFOPT_CACHE") or "~/.cache/mfopt").expanduser()


def _save_npz_atomic(path: pathlib.Path, **arrays: np.ndarray) -> None:
  """Writes ``arrays`` to ``path`` via a temporary file and ``os.replace``."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      np.savez(f, **arrays)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


# --- digits -------------------------------------------------------------------

DIGITS_NUM_TEST = 360


@register("digits")
def load_digits() -> Dataset:
  """scikit-learn's bundled 8x8 handwritten digits (1,797 images; no download).

  The split is fixed and uses no random numbers: the last 360 images (about
  20%, 33-37 per class) are the test set, the first 1,437 the training set.
  ``x`` is float32 in ``[0, 1]`` (pixel counts 0..16 divided by 16), shape
  ``(N, 8, 8, 1)``; ``y`` is int32.
  """
  from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top

  digits = sk_datasets.load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  n_train = len(y) - DIGITS_NUM_TEST
  return Dataset(
      name="digits",
      train=ArraySource(x[:n_train], y[:n_train]),
      test=ArraySource(x[n_train:], y[n_train:]),
      num_classes=10,
      input_shape=(8, 8, 1),
      meta={"num_train": n_train, "num_test": DIGITS_NUM_TEST,
            "description": "UCI optical handwritten digits, 8x8 grey levels 0..16, scaled to [0, 1]",
            "source": "sklearn.datasets.load_digits (bundled with scikit-learn)",
            "split": f"first {n_train} train, last {DIGITS_NUM_TEST} test (sklearn order)"},
  )


# --- mnist1d ------------------------------------------------------------------


def _generate_mnist1d(args: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
  """Runs ``mnist1d.data.make_dataset`` and returns all ``(x, y)`` in its order.

  ``make_dataset`` seeds NumPy's and Python's global generators; their state is
  restored afterwards so loading data does not perturb the caller's randomness.
  """
  from mnist1d import data as mnist1d_data  # pylint: disable=g-import-not-at-top
  from mnist1d import utils as mnist1d_utils  # pylint: disable=g-import-not-at-top

  np_state, py_state = np.random.get_state(), random.getstate()
  try:
    full = mnist1d_data.get_dataset_args(as_dict=True)
    full.update(args)
    data = mnist1d_data.make_dataset(mnist1d_utils.ObjectView(full))
  finally:
    np.random.set_state(np_state)
    random.setstate(py_state)
  x = np.concatenate([data["x"], data["x_test"]]).astype(np.float32)
  y = np.concatenate([data["y"], data["y_test"]]).astype(np.int32)
  return x, y


@register("mnist1d")
def load_mnist1d(num_train: int = 4000, num_test: int = 1000, seed: int = 42,
                 cache: bool = True) -> Dataset:
  """MNIST-1D (Greydanus, 2020), generated locally by ``mnist1d.data.make_dataset``.

  The generator's arguments are ``mnist1d.data.get_dataset_args()`` with
  ``num_samples``, ``train_split`` and ``seed`` overridden; the dataset is
  never downloaded (``mnist1d.data.get_dataset`` would). The defaults, 4000
  train / 1000 test with seed 42 (``num_samples=5000, train_split=0.8``), are
  the paper's dataset. ``make_dataset`` makes ``num_samples // 10`` examples per
  class, so ``num_samples`` is ``num_train + num_test`` rounded up to a multiple
  of 10 and the extra (shuffled) examples are dropped. The first ``num_train``
  of the generator's shuffled order are the training set.

  ``x`` is float32, shape ``(N, 40, 1)`` (a 1-D signal with a channel axis),
  standardised with the scalar mean and standard deviation of the training
  set; ``y`` is int32.

  Generation is single-threaded Python: 5,000 examples take about 1.1 s and
  100,000 about 24 s (measured on one core of this project's CPU machine), so
  the raw arrays are cached as ``mnist1d_<hash>.npz`` under :func:`cache_dir`,
  keyed by the generator arguments and written atomically (temporary file +
  ``os.replace``); a cache hit takes milliseconds.

  Args:
    num_train: training examples.
    num_test: test examples.
    seed: generator seed (the paper's is 42), in ``[0, 2**32)`` (NumPy's legacy seeding,
      which the mnist1d package uses).
    cache: read and write the ``.npz`` cache.
  """
  num_train = _checks.positive_int("num_train", num_train)
  num_test = _checks.positive_int("num_test", num_test)
  seed = _checks.nonnegative_int("seed", seed)
  if seed >= 2 ** 32:  # (else NumPy's error inside mnist1d, naming neither)
    raise ValueError(f"seed must be < 2**32 for mnist1d (its generator's NumPy seeding), got "
                     f"{seed!r}")
  total = num_train + num_test
  num_samples = 10 * math.ceil(total / 10)
  # `train_split` only moves the split point inside make_dataset; we split the
  # concatenated output ourselves, so it stays out of the cache key.
  gen_args = {"num_samples": num_samples, "seed": seed}
  from mnist1d import data as mnist1d_data  # pylint: disable=g-import-not-at-top

  key_args = mnist1d_data.get_dataset_args(as_dict=True)
  key_args.pop("url", None)
  key_args.pop("train_split", None)
  key_args.update(gen_args)
  key = hashlib.sha256(json.dumps(key_args, sort_keys=True).encode()).hexdigest()[:16]
  path = cache_dir() / f"mnist1d_{key}.npz"

  if cache and path.exists():
    with np.load(path) as f:
      x, y = f["x"], f["y"]
  else:
    x, y = _generate_mnist1d({**gen_args, "train_split": num_train / num_samples})
    if cache:
      _save_npz_atomic(path, x=x, y=y)

  x, y = x[:total, :, None], y[:total]
  mean, std = float(x[:num_train].mean(dtype=np.float64)), float(x[:num_train].std(dtype=np.float64))
  x = ((x - mean) / std).astype(np.float32)
  return Dataset(
      name="mnist1d",
      train=ArraySource(x[:num_train], y[:num_train]),
      test=ArraySource(x[num_train:], y[num_train:]),
      num_classes=10,
      input_shape=(40, 1),
      meta={"num_train": num_train, "num_test": num_test,
            "description": "MNIST-1D: 1-D signals of length 40 made from 10 digit templates "
                           "(Greydanus 2020), standardised with training statistics",
            "source": "mnist1d.data.make_dataset, generated locally",
            "generator_args": key_args, "train_mean": mean, "train_std": std,
            "cache_file": str(path) if cache else None},
  )


# --- synthetic ----------------------------------------------------------------


@register("synthetic")
def load_synthetic(num_train: int = 1024, num_test: int = 256,
                   input_shape: Sequence[int] | None = None, num_classes: int = 10,
                   seed: int = 0, task: str = "classification") -> Dataset:
  """Random arrays of any shape, for throughput work (nothing to learn).

  Classification: ``x`` standard normal float32 of shape ``input_shape``
  (default ``(32, 32, 3)``), ``y`` uniform int32 labels in ``[0, num_classes)``.
  Language model: random int32 token sequences in ``[0, num_classes)`` of
  length ``seq_len + 1`` with ``input_shape=(seq_len,)`` (default ``(64,)``),
  ``x = tokens[:-1]``, ``y = tokens[1:]``. Train and test use the generators
  ``default_rng([seed, 0])`` and ``default_rng([seed, 1])``.
  """
  num_train = _checks.positive_int("num_train", num_train)
  num_test = _checks.positive_int("num_test", num_test)
  num_classes = _checks.positive_int("num_classes", num_classes)
  seed = _checks.nonnegative_int("seed", seed)
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
  lm = task == "language_model"
  if input_shape is None:
    input_shape = (64,) if lm else (32, 32, 3)
  try:
    input_shape = tuple(_checks.positive_int("input_shape entries", d) for d in input_shape)
  except (TypeError, ValueError):
    raise ValueError(
        f"input_shape must be a sequence of positive integers, got {input_shape!r}") from None
  if lm and len(input_shape) != 1:
    raise ValueError(f"input_shape must be (seq_len,) for task='language_model', got {input_shape!r}")

  def make(n, stream):
    rng = np.random.default_rng([seed, stream])
    if lm:
      tokens = rng.integers(0, num_classes, size=(n, input_shape[0] + 1), dtype=np.int32)
      return ArraySource(tokens[:, :-1], tokens[:, 1:])
    x = rng.standard_normal((n, *input_shape), dtype=np.float32)
    return ArraySource(x, rng.integers(0, num_classes, size=n, dtype=np.int32))

  return Dataset(
      name="synthetic", train=make(num_train, 0), test=make(num_test, 1),
      num_classes=num_classes, input_shape=input_shape, task=task,
      meta={"num_train": num_train, "num_test": num_test, "seed": seed,
            "description": f"random {'tokens' if lm else 'Gaussian inputs and labels'} "
                           "for throughput measurements",
            "source": "numpy.random.default_rng"},
  )


# --- character-level text -----------------------------------------------------


def char_vocabulary(text: str) -> str:
  """The sorted distinct characters of ``text``; token ``i`` is ``vocab[i]``."""
  return "".join(sorted(set(text)))


def encode_chars(text: str, vocab: str) -> np.ndarray:
  """Maps every character of ``text`` to its index in ``vocab`` (int32)."""
  codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
  table = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)
  tokens = np.searchsorted(table, codes)
  found = table[np.minimum(tokens, len(table) - 1)] == codes if len(table) else np.zeros_like(codes, bool)
  if not found.all():
    missing = sorted(set(text) - set(vocab))
    raise ValueError(f"text has characters outside vocab: {''.join(missing)!r}")
  return tokens.astype(np.int32)


def char_sequences(tokens: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Cuts a token stream into ``(x, y)`` next-token pairs of shape ``(N, seq_len)``.

  Sequence ``i`` covers ``tokens[i*seq_len : (i+1)*seq_len + 1]`` (consecutive
  sequences share one boundary token); ``x`` is its first ``seq_len`` tokens,
  ``y`` its last ``seq_len``, so ``y[i, t] = x[i, t + 1]`` and every token after
  the first is a target exactly once. The incomplete tail is dropped.
  """
  seq_len = _checks.positive_int("seq_len", seq_len)
  n = (len(tokens) - 1) // seq_len
  if n < 1:
    raise ValueError(f"seq_len={seq_len} leaves no complete sequence in {len(tokens)} tokens")
  stream = np.asarray(tokens, dtype=np.int32)[: n * seq_len + 1]
  return stream[:-1].reshape(n, seq_len), stream[1:].reshape(n, seq_len)


# Modules whose docstrings make up `textcorpus` (sorted; ~347k characters on
# CPython 3.11). Chosen for long, well-written English prose and no import-time
# side effects.
TEXTCORPUS_MODULES = (
    "argparse", "ast", "calendar", "collections", "configparser", "contextlib", "csv",
    "dataclasses", "difflib", "doctest", "email.message", "enum", "functools", "http.client",
    "inspect", "itertools", "json", "logging", "os", "pathlib", "random", "re", "shutil",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "typing", "unittest.case", "unittest.mock", "urllib.parse", "zipfile",
)


def _own_doc(obj: Any) -> str | None:
  doc = getattr(obj, "__doc__", None)
  return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def _module_docs(module_name: str) -> list[str]:
  """Own docstrings of a module, its public classes and functions and their methods."""
  module = importlib.import_module(module_name)
  docs = [_own_doc(module)]
  for name in sorted(vars(module)):
    obj = vars(module)[name]
    if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
      continue
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
      continue
    docs.append(_own_doc(obj))
    if inspect.isclass(obj):
      for member_name in sorted(vars(obj)):
        member = vars(obj)[member_name]
        if member_name.startswith("_"):
          continue
        if isinstance(member, (staticmethod, classmethod)):
          member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
          docs.append(_own_doc(member))
  return [d for d in docs if d]


@functools.cache
def textcorpus_text() -> str:
  """The ``textcorpus`` text: docstrings of :data:`TEXTCORPUS_MODULES`, in order.

  Per module: the module docstring, then for each public class or function
  defined there (sorted by name) its own docstring (``inspect.cleandoc``; no
  inherited ones) followed, for classes, by its public methods' and properties'
  docstrings (sorted by name). Documents are joined by a blank line. The text
  is deterministic for a given Python version; docstrings change between
  CPython releases, so ``meta`` records the version and a SHA-256.
  """
  docs: list[str] = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # e.g. typing.io on 3.11
    for module_name in TEXTCORPUS_MODULES:
      docs.extend(_module_docs(module_name))
  return "\n\n".join(docs)


def _char_lm_dataset(name: str, train_text: str, test_text: str, vocab: str, seq_len: int,
                     meta: dict[str, Any]) -> Dataset:
  x_train, y_train = char_sequences(encode_chars(train_text, vocab), seq_len)
  x_test, y_test = char_sequences(encode_chars(test_text, vocab), seq_len)
  return Dataset(
      name=name,
      train=ArraySource(x_train, y_train),
      test=ArraySource(x_test, y_test),
      num_classes=len(vocab),
      input_shape=(seq_len,),
      task="language_model",
      meta={"num_train": len(x_train), "num_test": len(x_test), "seq_len": seq_len,
            "vocab_size": len(vocab), "vocab": vocab, "train_chars": len(train_text),
            "test_chars": len(test_text), **meta},
  )


@register("textcorpus", task="language_model")
def load_textcorpus(seq_len: int = 64) -> Dataset:
  """Character-level English corpus built offline from Python's own documentation.

  The default corpus for the LSTM language-model experiment: tiny_shakespeare
  cannot be downloaded on this project's machines, while this text ships with
  every Python. It is :func:`textcorpus_text` (the docstrings of 35 standard
  library modules, :data:`TEXTCORPUS_MODULES`; 346,933 characters and 100
  distinct ones on CPython 3.11.7; other Python releases, patch releases too, have other
  docstrings: 353,084 and 97 on 3.12.1, so ``meta["sha256"]`` identifies it), split
  contiguously into the first 90% of characters for training and the last 10% for
  validation (the ``test`` source). The vocabulary is the sorted characters of the whole
  text and is in ``meta["vocab"]``. Each split is cut by :func:`char_sequences`:
  ``x = tokens[:-1]``, ``y = tokens[1:]`` per sequence, both ``(N, seq_len)``
  int32.

  Args:
    seq_len: characters per input sequence.
  """
  seq_len = _checks.positive_int("seq_len", seq_len)
  text = textcorpus_text()
  cut = int(0.9 * len(text))
  return _char_lm_dataset(
      "textcorpus", text[:cut], text[cut:], char_vocabulary(text), seq_len,
      meta={"description": "character-level English prose: docstrings of "
                           f"{len(TEXTCORPUS_MODULES)} Python standard-library modules",
            "source": f"inspect over CPython {sys.version.split()[0]} standard library",
            "modules": list(TEXTCORPUS_MODULES),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "split": "first 90% of characters train, last 10% validation"},
  )


# --- image preprocessing (NumPy + PIL) ----------------------------------------

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def random_crop_flip(image: np.ndarray, rng: np.random.Generator, padding: int = 4) -> np.ndarray:
  """Zero-pads ``padding`` pixels per side, crops back to the input size at a
  uniformly random offset, and flips horizontally with probability 1/2.

  ``image`` is ``(H, W, C)``; torchvision's ``RandomCrop(32, padding=4)`` +
  ``RandomHorizontalFlip()`` on CIFAR.
  """
  h, w = image.shape[:2]
  padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
  top, left = rng.integers(0, 2 * padding + 1, size=2)
  out = padded[top:top + h, left:left + w]
  if rng.random() < 0.5:
    out = out[:, ::-1]
  return out


def _resize(image: np.ndarray, size_hw: tuple[int, int],
            box: tuple[int, int, int, int] | None = None) -> np.ndarray:
  """Bilinear resize of a uint8 ``(H, W, C)`` image (optionally of the crop
  ``box = (left, top, right, bottom)``) to ``size_hw`` with PIL."""
  from PIL import Image  # pylint: disable=g-import-not-at-top

  squeeze = image.ndim == 3 and image.shape[-1] == 1
  pil = Image.fromarray(np.ascontiguousarray(image[..., 0] if squeeze else image))
  out = np.asarray(pil.resize((size_hw[1], size_hw[0]), Image.BILINEAR, box=box))
  return out[..., None] if squeeze else out


def random_resized_crop(image: np.ndarray, rng: np.random.Generator, size: int = 224,
                        scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
  """Inception-style crop: a random area fraction and aspect ratio, resized to ``size``.

  torchvision's ``RandomResizedCrop`` algorithm: up to 10 tries of an area
  fraction ``U(scale)`` of the image and a log-uniform aspect ratio in
  ``ratio``; if no try fits, a center crop with the ratio clamped to ``ratio``.
  Bilinear resampling (PIL). Returns uint8 ``(size, size, C)``.
  """
  h, w = image.shape[:2]
  area = h * w
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target_area = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(*log_ratio))
    cw = int(round(math.sqrt(target_area * aspect)))
    ch = int(round(math.sqrt(target_area / aspect)))
    if 0 < cw <= w and 0 < ch <= h:
      top = int(rng.integers(0, h - ch + 1))
      left = int(rng.integers(0, w - cw + 1))
      break
  else:
    in_ratio = w / h
    if in_ratio < ratio[0]:
      cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
      ch, cw = h, int(round(h * ratio[1]))
    else:
      cw, ch = w, h
    top, left = (h - ch) // 2, (w - cw) // 2
  return _resize(image, (size, size), box=(left, top, left + cw, top + ch))


def _check_crop(size: int, resize_size: int) -> None:
  if not size <= resize_size:  # (a negative crop offset sliced a strip: (299, 22, 3) at 299)
    raise ValueError(f"image_size {size!r} must be <= resize_size {resize_size!r}: the evaluation "
                     f"crop is taken from the image resized to resize_size on its shorter side; "
                     f"pass e.g. resize_size={round(size * 256 / 224)}")


def resize_center_crop(image: np.ndarray, size: int = 224, resize_size: int = 256) -> np.ndarray:
  """Resizes the shorter side to ``resize_size`` (bilinear), then center-crops ``size``.

  The standard ImageNet evaluation transform. Returns uint8 ``(size, size, C)``.
  """
  _check_crop(size, resize_size)
  h, w = image.shape[:2]
  if h <= w:
    nh, nw = resize_size, max(resize_size, int(round(w * resize_size / h)))
  else:
    nh, nw = max(resize_size, int(round(h * resize_size / w))), resize_size
  resized = _resize(image, (nh, nw))
  top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
  return resized[top:top + size, left:left + size]


def _normalize(image: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
  """``(image / 255 - mean) / std`` in float32, computed in place on one buffer: the same
  values as the expression with three temporaries and no extra allocations (measured 1.5-4%
  faster at 224x224x3, ratios 0.962-0.985 over session 13's twelve bench_input runs:
  BENCHMARKS.md, "Input pipeline")."""
  mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
  x = np.empty(np.broadcast_shapes(np.shape(image), mean.shape, std.shape), np.float32)
  x[...] = image  # broadcasts a one-channel image against three-channel statistics
  np.divide(x, np.float32(255.0), out=x)
  np.subtract(x, mean, out=x)
  np.divide(x, std, out=x)
  return x


def mnist_preprocess(example: Mapping[str, Any], rng: np.random.Generator | None = None) -> Batch:
  """TFDS MNIST example -> ``x`` float32 ``(28, 28, 1)`` in ``[0, 1]``, ``y`` int32. No augmentation."""
  del rng
  return {"x": np.asarray(example["image"], np.float32) / 255.0,
          "y": np.asarray(example["label"], np.int32)}


def make_cifar_preprocess(mean: Sequence[float], std: Sequence[float],
                          augment: bool = True) -> Preprocess:
  """CIFAR example -> normalised float32 ``(32, 32, 3)``; training: pad-4 crop + flip."""

  def preprocess(example: Mapping[str, Any], rng: np.random.Generator | None = None) -> Batch:
    image = np.asarray(example["image"])
    if rng is not None and augment:
      image = random_crop_flip(image, rng, padding=4)
    return {"x": _normalize(image, mean, std), "y": np.asarray(example["label"], np.int32)}

  return preprocess


def make_imagenet_preprocess(size: int = 224, resize_size: int = 256) -> Preprocess:
  """ImageNet example -> normalised float32 ``(size, size, 3)``.

  Training (``rng`` given): :func:`random_resized_crop` with scale
  ``(0.08, 1)`` and ratio ``(3/4, 4/3)``, then a horizontal flip with
  probability 1/2. Evaluation: :func:`resize_center_crop` (shorter side to
  ``resize_size``, center ``size`` crop; ``size <= resize_size``). Both normalise with the
  ImageNet channel mean and standard deviation.
  """
  # (0, a float or True went through: empty images, a PIL error naming neither argument)
  size = _checks.positive_int("image_size", size)
  resize_size = _checks.positive_int("resize_size", resize_size)
  _check_crop(size, resize_size)  # (before any training, not at the first evaluation)

  def preprocess(example: Mapping[str, Any], rng: np.random.Generator | None = None) -> Batch:
    image = np.asarray(example["image"])
    if rng is not None:
      image = random_resized_crop(image, rng, size=size)
      if rng.random() < 0.5:
        image = image[:, ::-1]
    else:
      image = resize_center_crop(image, size=size, resize_size=resize_size)
    return {"x": _normalize(image, IMAGENET_MEAN, IMAGENET_STD),
            "y": np.asarray(example["label"], np.int32)}

  return preprocess


# --- TFDS datasets ------------------------------------------------------------


def _tfds_meta(name: str, train: TFDSSource, test: TFDSSource, description: str,
               preprocessing: str) -> dict[str, Any]:
  return {"num_train": len(train), "num_test": len(test), "description": description,
          "source": f"tfds.data_source({name!r}) from {train.data_dir}",
          "splits": [train.split, test.split], "preprocessing": preprocessing}


@register("mnist")
def load_mnist(data_dir: str | None = None) -> Dataset:
  """MNIST from a prepared TFDS data dir: ``x`` in ``[0, 1]``, ``(28, 28, 1)``; no augmentation."""
  train = TFDSSource("mnist", split="train", preprocess=mnist_preprocess, data_dir=data_dir,
                     augments=False)
  test = TFDSSource("mnist", split="test", preprocess=mnist_preprocess, data_dir=data_dir,
                    augments=False)
  return Dataset("mnist", train, test, num_classes=10, input_shape=(28, 28, 1),
                 meta=_tfds_meta("mnist", train, test, "MNIST handwritten digits",
                                 "scale to [0, 1]"))


def _load_cifar(name: str, num_classes: int, mean, std, data_dir, augment) -> Dataset:
  preprocess = make_cifar_preprocess(mean, std, augment=augment)
  train = TFDSSource(name, split="train", preprocess=preprocess, data_dir=data_dir,
                     augments=augment)
  test = TFDSSource(name, split="test", preprocess=preprocess, data_dir=data_dir,
                    augments=augment)
  steps = "pad-4 random crop 32 + horizontal flip (train), " if augment else ""
  return Dataset(name, train, test, num_classes=num_classes, input_shape=(32, 32, 3),
                 meta=_tfds_meta(name, train, test, f"{name.upper()} 32x32 colour images",
                                 f"{steps}per-channel normalisation mean={mean} std={std}"))


@register("cifar10")
def load_cifar10(data_dir: str | None = None, augment: bool = True) -> Dataset:
  """CIFAR-10 from a prepared TFDS data dir; see :func:`make_cifar_preprocess`."""
  return _load_cifar("cifar10", 10, CIFAR10_MEAN, CIFAR10_STD, data_dir, augment)


@register("cifar100")
def load_cifar100(data_dir: str | None = None, augment: bool = True) -> Dataset:
  """CIFAR-100 (fine labels) from a prepared TFDS data dir; see :func:`make_cifar_preprocess`."""
  return _load_cifar("cifar100", 100, CIFAR100_MEAN, CIFAR100_STD, data_dir, augment)


@register("imagenet2012")
def load_imagenet2012(data_dir: str | None = None, image_size: int = 224,
                      resize_size: int = 256) -> Dataset:
  """ImageNet-1k from a prepared TFDS data dir (validation split as test).

  See :func:`make_imagenet_preprocess`. Decoding and resizing run per example
  in Python; in a multi-process run each process decodes only its own workers'
  examples (``WorkerBatcher.batch(step, workers)``; each example's augmentation has
  its own seed), so the work per step is split over the processes.
  """
  preprocess = make_imagenet_preprocess(image_size, resize_size)  # (validates both)
  threads = default_data_threads(decode_heavy=True)  # JPEG decodes release the GIL
  train = TFDSSource("imagenet2012", split="train", preprocess=preprocess, data_dir=data_dir,
                     num_threads=threads)
  test = TFDSSource("imagenet2012", split="validation", preprocess=preprocess, data_dir=data_dir,
                    num_threads=threads)
  return Dataset("imagenet2012", train, test, num_classes=1000,
                 input_shape=(image_size, image_size, 3),
                 meta=_tfds_meta("imagenet2012", train, test, "ImageNet ILSVRC-2012, 1000 classes",
                                 f"train: random-resized-crop {image_size} (scale (0.08, 1), ratio "
                                 f"(3/4, 4/3)) + flip; eval: resize {resize_size} + center crop "
                                 f"{image_size}; ImageNet mean/std normalisation"))


def _tfds_text(name: str, split: str, data_dir: str | None) -> str:
  source = open_tfds(name, split=split, data_dir=data_dir)
  texts = [source[i]["text"] for i in range(len(source))]
  return "".join(t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in texts)


@register("tiny_shakespeare", task="language_model")
def load_tiny_shakespeare(data_dir: str | None = None, seq_len: int = 64,
                          test_split: str = "test") -> Dataset:
  """Tiny Shakespeare (Karpathy's char-rnn corpus) from a prepared TFDS data dir.

  Each split is one example whose ``text`` feature is the whole text (the texts
  of all examples of a split are concatenated in order). The character
  vocabulary is the sorted characters of the train and ``test_split`` texts
  (``meta["vocab"]``); sequences are cut like ``textcorpus``
  (:func:`char_sequences`).
  """
  seq_len = _checks.positive_int("seq_len", seq_len)
  train_text = _tfds_text("tiny_shakespeare", "train", data_dir)
  test_text = _tfds_text("tiny_shakespeare", test_split, data_dir)
  return _char_lm_dataset(
      "tiny_shakespeare", train_text, test_text, char_vocabulary(train_text + test_text), seq_len,
      meta={"description": "Tiny Shakespeare, character level",
            "source": f"tfds.data_source('tiny_shakespeare') from {tfds_data_dir(data_dir)}",
            "splits": ["train", test_split]})


# ------------------------------------------------------------------------------
# Batching.
# ------------------------------------------------------------------------------


class WorkerBatcher:
  """Deterministic, step-addressable batches for ``num_workers`` workers.

  ``batch(step)`` depends only on ``(seed, step)`` and the source: with
  ``G = num_workers * per_worker_batch`` and ``S = len(source) // G`` steps per
  epoch (the remainder of each epoch is dropped),

  * ``epoch = step // S``; the epoch's order is
    ``np.random.default_rng([seed, epoch]).permutation(len(source))``
    (``arange`` when ``shuffle=False``);
  * the step takes the slice ``[(step % S) * G, (step % S + 1) * G)`` of that
    order and splits it into ``num_workers`` contiguous chunks, worker ``w``
    getting chunk ``w``;
  * augmentation (``train=True``) draws from
    ``np.random.default_rng([seed, step, 1])`` over the whole global batch, or, for a
    source with ``per_example_rng`` (:class:`TFDSSource`), the example at position ``j``
    of the step's global batch (``j = w * per_worker_batch + i``) draws from its own
    ``np.random.default_rng([seed, step, 1, j])``.

  So a run resumes exactly from a step number, every example is seen exactly
  once per epoch (minus the dropped remainder) across all workers, and two
  worker counts with equal global batch process the same examples, with the
  same augmentation, at every step.

  ``batch(step, workers=slice(a, b))`` equals ``batch(step)`` restricted to workers
  ``a..b-1``, and is what a process of a multi-process run reads (its own workers'
  rows). It reads and preprocesses only those rows unless the source augments a
  batch with one shared generator (an :class:`ArraySource` with ``augment``, or a
  source without ``per_example_rng``), where the whole global batch must be drawn
  and the rows are then cut from it.

  Args:
    source: a :class:`Source`.
    num_workers: workers ``W``.
    per_worker_batch: examples per worker per step ``B``.
    seed: non-negative integer.
    train: apply the source's augmentation.
    shuffle: permute each epoch (else fixed index order).
  """

  def __init__(self, source: Source, *, num_workers: int, per_worker_batch: int, seed: int,
               train: bool = True, shuffle: bool = True):
    self.source = source
    self.num_workers = _checks.positive_int("num_workers", num_workers)
    self.per_worker_batch = _checks.positive_int("per_worker_batch", per_worker_batch)
    self.seed = _checks.nonnegative_int("seed", seed)
    self.train, self.shuffle = bool(train), bool(shuffle)
    self.num_examples = len(source)
    if self.num_examples <= 0:
      raise ValueError(f"source must be non-empty, got len(source)={self.num_examples}")
    if self.global_batch > self.num_examples:
      raise BatchTooLargeError(
          f"global batch num_workers * per_worker_batch = {self.num_workers} * "
          f"{self.per_worker_batch} = {self.global_batch} exceeds the dataset size "
          f"{self.num_examples} (lower the batch or the workers, or use more examples)")
    self._cached_epoch: int | None = None
    self._cached_order: np.ndarray | None = None

  @property
  def global_batch(self) -> int:
    """``num_workers * per_worker_batch``."""
    return self.num_workers * self.per_worker_batch

  @property
  def steps_per_epoch(self) -> int:
    """``len(source) // global_batch`` (the remainder is dropped)."""
    return self.num_examples // self.global_batch

  def epoch_of(self, step: int) -> int:
    """The epoch ``step`` belongs to."""
    return _checks.nonnegative_int("step", step) // self.steps_per_epoch

  def epoch_order(self, epoch: int) -> np.ndarray:
    """The example order of ``epoch``, a permutation of ``range(len(source))``."""
    epoch = _checks.nonnegative_int("epoch", epoch)
    if epoch != self._cached_epoch:
      if self.shuffle:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
      else:
        order = np.arange(self.num_examples)
      order.flags.writeable = False  # indices()/epoch_order() return views of it: a caller
      # editing one in place would change every later batch of the epoch
      self._cached_epoch, self._cached_order = epoch, order
    return self._cached_order

  def indices(self, step: int) -> np.ndarray:
    """Example indices of ``step``, int array ``(num_workers, per_worker_batch)``."""
    step = _checks.nonnegative_int("step", step)
    epoch, position = divmod(step, self.steps_per_epoch)
    start = position * self.global_batch
    order = self.epoch_order(epoch)
    return order[start:start + self.global_batch].reshape(self.num_workers, self.per_worker_batch)

  def batch(self, step: int, workers: slice | None = None) -> Batch:
    """The batch of ``step``: each array has shape ``(num_workers, per_worker_batch, ...)``.

    Args:
      step: non-negative step.
      workers: only these workers' rows (a ``slice`` of ``range(num_workers)`` with
        step 1, e.g. :func:`mfopt.parallel.process_worker_slice`); the leading axis
        is then their count. Equal to ``batch(step)[workers]`` (see the class doc).
    """
    idx = self.indices(step)
    rows = self._rows(workers)
    count = len(range(self.num_workers)[rows])
    wanted = idx[rows].reshape(-1)
    if not self.train or not getattr(self.source, "augments", True):  # no augmentation
      flat = self.source.get(wanted, None)
    elif getattr(self.source, "per_example_rng", False):
      positions = np.arange(self.global_batch).reshape(idx.shape)[rows].reshape(-1)
      flat = self.source.get(wanted, [np.random.default_rng([self.seed, int(step), 1, int(j)])
                                      for j in positions])
    elif rows == slice(0, self.num_workers):
      flat = self.source.get(wanted, np.random.default_rng([self.seed, int(step), 1]))
    else:  # one generator over the whole global batch: draw it all, keep the rows
      whole = self.source.get(idx.reshape(-1), np.random.default_rng([self.seed, int(step), 1]))
      flat = {k: v.reshape((self.num_workers, -1) + v.shape[1:])[rows].reshape(
          (-1,) + v.shape[1:]) for k, v in whole.items()}
    return {k: v.reshape((count, self.per_worker_batch) + v.shape[1:]) for k, v in flat.items()}

  def _rows(self, workers: slice | None) -> slice:
    """``workers`` as ``slice(a, b)`` with ``0 <= a < b <= num_workers``; all workers if None."""
    if workers is None:
      return slice(0, self.num_workers)
    if not isinstance(workers, slice) or workers.step not in (None, 1):
      raise ValueError(f"workers must be a slice of range(num_workers={self.num_workers}) with "
                       f"step 1, got {workers!r}")
    a, b, _ = workers.indices(self.num_workers)
    if a >= b:
      raise ValueError(f"workers selects no worker of range(num_workers={self.num_workers}): "
                       f"{workers!r}")
    return slice(a, b)

  def __repr__(self) -> str:
    return (f"WorkerBatcher({self.source!r}, num_workers={self.num_workers}, "
            f"per_worker_batch={self.per_worker_batch}, seed={self.seed}, train={self.train}, "
            f"shuffle={self.shuffle})")


def eval_batches(source: Source, batch_size: int, *,
                 shard: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
  """Every example of ``source`` once, in index order, in batches of fixed shape.

  Yields ``{"x", "y", "mask"}`` with leading axis ``batch_size``, without
  augmentation (``rng=None``). The last batch is padded with zeros up to
  ``batch_size`` so a jitted evaluation compiles once; ``mask`` (bool,
  ``(batch_size,)``) is ``True`` exactly on real examples, so weight
  per-example sums by it (``sum(mask)`` over all batches is ``len(source)``).

  ``shard=(i, n)`` yields (and reads) only batches ``i, i + n, i + 2n, ...``: one
  of ``n`` processes' share (``mfopt.train.evaluate`` in a multi-process run).
  """
  batch_size = _checks.positive_int("batch_size", batch_size)
  index, count = shard
  _checks.positive_int("shard count", count)
  if not 0 <= index < count:
    raise ValueError(f"shard index must be in [0, {count}), got shard={shard!r}")
  n = len(source)
  for start in range(index * batch_size, n, count * batch_size):
    stop = min(start + batch_size, n)
    batch = source.get(np.arange(start, stop), None)
    pad = batch_size - (stop - start)
    if pad:
      batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
               for k, v in batch.items()}
    mask = np.zeros(batch_size, dtype=bool)
    mask[: stop - start] = True
    batch["mask"] = mask
    yield batch
