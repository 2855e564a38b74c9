"""Input pipeline throughput: ``TFDSSource`` reading on 1 thread vs ``--threads`` threads.

Command: ``python -m experiments.bench_input [--quick] [--reps N] [--threads N] [--batch N]
[--dataset imagenet2012|cifar10] [--json PATH]``

What runs (``--dataset imagenet2012``, the default) is the training input of an ImageNet run
(``mfopt.data.load("imagenet2012")``: ``TFDSSource`` + ``WorkerBatcher`` +
random-resized-crop/flip/normalise at 224), on
``tfds.testing.mock_data`` examples, since no ImageNet is prepared here. The mock's images are
random arrays of random small size, so the bench replaces each example's image by one of 16
synthetic 375 x 500 JPEGs decoded with PIL, the size of a typical ImageNet photo and the decode
TFDS does for a stored JPEG: a stand-in for the real decode cost, not ImageNet itself.
``--dataset cifar10`` does the same for a CIFAR-10 run (``mfopt.data.load("cifar10")``: pad-4
crop + flip + normalise) with 16 synthetic 32 x 32 PNGs, the format TFDS stores CIFAR in: the
case where each example is little work and Python holds the GIL for most of it. Reported:
examples/s of ``WorkerBatcher.batch`` per thread count (interleaved repetitions, median), their
ratio, and whether the batches are identical (they must be: each example has its own
augmentation stream); and the time of ``mfopt.data._normalize`` against the expression with
three temporaries it replaced (same values). Figures only, no targets (issue 8 has none for
input).
"""

from __future__ import annotations

import io
import os
import time
from typing import Any, Sequence

import numpy as np

from experiments import _bench


class _EncodedImages:
  """An example source that returns the mock's example with a decoded synthetic image."""

  def __init__(self, source, images: list[bytes]):
    self.source, self.images = source, images

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, i: int) -> dict[str, Any]:
    from PIL import Image
    example = dict(self.source[i])
    with Image.open(io.BytesIO(self.images[i % len(self.images)])) as im:
      example["image"] = np.asarray(im.convert("RGB"))
    return example


def _encoded(n: int, size: tuple[int, int], fmt: str) -> list[bytes]:
  from PIL import Image
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):  # smooth noise compresses like a photo more than white noise does
    small = rng.integers(0, 255, (max(size[0] // 8, 1), max(size[1] // 8, 1), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((size[1], size[0]), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    out.append(buf.getvalue())
  return out


def _normalize_figures(report, reps: int, size: int) -> None:
  """``data._normalize`` (in place) against the three-temporary expression it replaced."""
  import timeit

  from mfopt import data
  image = np.random.default_rng(1).integers(0, 255, (size, size, 3), dtype=np.uint8)
  mean, std = data.IMAGENET_MEAN, data.IMAGENET_STD

  def temporaries():
    return (image.astype(np.float32) / 255.0 - np.asarray(mean, np.float32)) / np.asarray(
        std, np.float32)

  def in_place():
    return data._normalize(image, mean, std)

  same = np.array_equal(temporaries(), in_place())
  t = {f.__name__: [] for f in (temporaries, in_place)}
  for _ in range(reps):  # interleaved
    for f in (temporaries, in_place):
      t[f.__name__].append(timeit.timeit(f, number=100) / 100)
  med = {k: float(np.median(v)) for k, v in t.items()}
  report.figure("normalize, three temporaries", med["temporaries"] * 1e3, "ms",
                f"{size}x{size}x3 uint8 -> float32, median of {reps} x 100 calls")
  report.figure("normalize, in place (data._normalize)", med["in_place"] * 1e3, "ms",
                f"ratio {med['in_place'] / med['temporaries']:.3f}; "
                + ("same values" if same else "VALUES DIFFER"), identical_values=same)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  def extra(p):
    p.add_argument("--threads", type=int, default=max(2, min(16, os.cpu_count() or 1)),
                   help="threads of the threaded reader, >= 2 (default min(16, CPUs), at least 2)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 256)")
    p.add_argument("--dataset", choices=("imagenet2012", "cifar10"), default="imagenet2012",
                   help="whose training input to read (default imagenet2012)")

  args = _bench.parse_args(argv, __doc__.splitlines()[0], extra)
  report = _bench.Report("bench_input", args)
  import tensorflow_datasets as tfds

  from mfopt import data
  batch = args.batch or (16 if args.quick else 256)
  reps = args.reps or (1 if args.quick else 5)
  threads = args.threads
  if threads < 2:
    raise SystemExit(f"--threads must be >= 2 (it is compared with 1 thread), got {threads}")
  cifar = args.dataset == "cifar10"
  image = (32, 32) if cifar else (60, 80) if args.quick else (375, 500)
  with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE,
                              num_examples=max(4 * batch, 64)):
    if cifar:
      ds = data.load("cifar10", data_dir="/nonexistent")
    else:
      ds = data.load("imagenet2012", data_dir="/nonexistent",
                     image_size=64 if args.quick else 224, resize_size=72 if args.quick else 256)
    src = ds.train
    src._source = _EncodedImages(src._source, _encoded(16, image, "PNG" if cifar else "JPEG"))
    batcher = data.WorkerBatcher(src, num_workers=8, per_worker_batch=batch // 8, seed=0)
    times: dict[int, list[float]] = {1: [], threads: []}
    first: dict[int, dict[str, np.ndarray]] = {}
    for rep in range(reps + 1):  # rep 0: warm-up (thread pool, PIL, caches)
      for n in (1, threads):
        src.num_threads = n
        t = time.perf_counter()
        b = batcher.batch(rep)
        dt = time.perf_counter() - t
        if rep == 0:
          first[n] = b
        else:
          times[n].append(dt)
  same = all(np.array_equal(first[1][k], first[threads][k]) for k in first[1])
  _normalize_figures(report, reps, size=64 if args.quick else 224)
  rate = {n: batch / float(np.median(ts)) for n, ts in times.items()}
  report.figure("examples/s, 1 thread", rate[1], "ex/s",
                f"{args.dataset}: global batch {batch}, {image[0]}x{image[1]} "
                + ("PNG decode + pad-4 crop/flip" if cifar else "JPEG decode + random-resized-crop")
                + f", median of {reps}", threads=1)
  report.figure(f"examples/s, {threads} threads", rate[threads], "ex/s",
                f"host CPUs {os.cpu_count()}", threads=threads)
  report.figure(f"ratio {threads} threads / 1 thread", rate[threads] / rate[1], "x",
                "same batches" if same else "BATCHES DIFFER", identical_batches=same)
  return report.finish()


if __name__ == "__main__":
  main()
