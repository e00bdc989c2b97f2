"""The image-folder pipeline: decoders, the seeded crop shared by the CPU and device paths, the evaluation
pixels, and a loader whose persistent workers keep the seeded order and the resume exact."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from repmlp.data import DataConfig, GpuTrainBatch, build_data, folder_eval_pixels, folder_eval_transform
from repmlp.data.folder import (
    EvalPixels,
    ImageFolderData,
    TrainCrop,
    _fast_jpeg,
    decode_pixels,
    device_crop_batch,
    image_to_channels,
    train_crop_params,
)
from repmlp.data.inputs import open_image
from repmlp.data.loader import FolderLoader, default_workers
from repmlp.errors import UserError


def _smooth(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Smooth random RGB pixels (JPEG-friendly, so the decoders' rounding is what is compared)."""
    small = rng.integers(0, 256, (4, 4, 3)).astype(np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    rng = np.random.default_rng(0)
    out = {}
    for i, (h, w) in enumerate([(40, 56), (64, 48), (50, 50)]):
        out[f"rgb{i}"] = root / f"rgb{i}.jpg"
        Image.fromarray(_smooth(rng, h, w)).save(out[f"rgb{i}"], quality=90)
    out["grey"] = root / "grey.jpg"
    Image.fromarray(_smooth(rng, 36, 44)[:, :, 0]).save(out["grey"])
    out["cmyk"] = root / "cmyk.jpg"
    Image.fromarray(_smooth(rng, 30, 30)).convert("CMYK").save(out["cmyk"])
    out["png"] = root / "img.png"
    Image.fromarray(_smooth(rng, 33, 47)).save(out["png"])
    data = out["rgb0"].read_bytes()
    out["truncated"] = root / "truncated.jpg"
    out["truncated"].write_bytes(data[: len(data) // 2])
    return out


def _pillow(path: Path, channels: int) -> torch.Tensor:
    with open_image(path) as im:
        arr = np.array(image_to_channels(im, channels))
    return torch.from_numpy(arr.reshape(arr.shape[0], arr.shape[1], -1)).permute(2, 0, 1)


def test_decoders_give_pillows_pixels_and_name_a_bad_file(files):
    """The fast JPEG decoder where it applies, Pillow elsewhere: the same pixels in every case."""
    assert _fast_jpeg(str(files["rgb0"]), 3) is not None and _fast_jpeg(str(files["grey"]), 1) is not None
    assert _fast_jpeg(str(files["cmyk"]), 3) is None and _fast_jpeg(str(files["truncated"]), 3) is None
    for name in ("rgb0", "rgb1", "grey", "cmyk", "png"):
        for channels in (1, 3):
            x = decode_pixels(str(files[name]), channels)
            assert x.dtype == torch.uint8 and torch.equal(x, _pillow(files[name], channels)), (name, channels)
    with pytest.raises(UserError, match=f"cannot read image {files['truncated']}"):
        decode_pixels(str(files["truncated"]), 3)


def test_device_crop_applies_the_cpu_paths_seeded_boxes_and_flips(files):
    """The crop box and flip are a pure function of (seed, epoch, index, size); the device pipeline (here
    on CPU tensors) applies them to the pixels within the uint8 rounding of the CPU path."""
    names = ["rgb0", "rgb1", "rgb2", "grey", "png"]
    samples = [(str(files[n]), i) for i, n in enumerate(names)]
    data = ImageFolderData(samples, TrainCrop(24, flip=True), seed=3, train=True)
    flips = set()
    for epoch in (0, 1):
        for index, (path, _) in enumerate(samples):
            pixels = decode_pixels(path, 3)
            p = train_crop_params(3, epoch, index, *pixels.shape[-2:], flip=True)
            flips.add(p.flip)
            cpu = data[(index, epoch)][0]
            assert torch.equal(cpu, data.transform.apply(pixels, p))  # the dataset drew the same box
            device = device_crop_batch([pixels], [p], 24)[0]
            # uint8 rounding (0.5) plus the uint8 kernel's fixed-point weights
            diff = (device - cpu.float()).abs()
            assert diff.max() <= 1.01 and diff.mean() < 0.4, (epoch, index)
    assert flips == {True, False}
    # The batched device side as the loader runs it: the JPEGs travel undecoded, the PNG decoded.
    data.raw_jpeg = True
    items = [data[(i, 1)] for i in range(len(samples))]
    assert [isinstance(x, tuple) for x, _ in items] == [True, True, True, True, False]
    batch = GpuTrainBatch(data)([x for x, _ in items], torch.arange(5), torch.device("cpu"))
    data.raw_jpeg = False
    cpu = torch.stack([data[(i, 1)][0] for i in range(len(samples))]).float()
    assert batch.shape == (5, 3, 24, 24) and (batch - cpu).abs().max() <= 1.01
    # A file the device decoder refuses goes through the CPU path, which names a bad file.
    bad = ImageFolderData([(str(files["truncated"]), 0)], TrainCrop(24, flip=True), seed=3, train=True)
    junk = (torch.frombuffer(bytearray(b"\xff\xd8\xff\xe0junk\xff\xd9"), dtype=torch.uint8), p, 0, 1)
    with pytest.raises(UserError, match=f"cannot read image {files['truncated']}"):
        GpuTrainBatch(bad)([junk], torch.zeros(1, dtype=torch.int64), torch.device("cpu"))


@pytest.mark.parametrize("pre", [None, {"crop_pct": 0.9, "interpolation": "bicubic", "mean": [0.5] * 3}])
def test_eval_pixels_normalised_on_the_device_are_predicts_values(files, pre):
    """The loader's uint8 evaluation pixels, normalised after the move, are bitwise what `repmlp predict`'s
    float transform gives (so `repmlp eval` and `repmlp predict` still see the same values)."""
    pil, mean, std = folder_eval_pixels(20, pre)
    loader = FolderLoader(
        ImageFolderData([(str(files[n]), 0) for n in ("rgb1", "png")], EvalPixels(pil), 0, False),
        batch_size=2, train=False, workers=0, mean=mean, std=std,
    )  # fmt: skip
    x, _ = next(loader.batches(0))
    want = torch.stack([folder_eval_transform(20, pre)(image_to_channels(open_image(files[n]), 3))
                        for n in ("rgb1", "png")])  # fmt: skip
    assert x.dtype == torch.float32 and torch.equal(x, want)


def test_persistent_workers_keep_the_seeded_order_and_the_resume_exact(tmp_path):
    """One DataLoader and the same worker processes for every epoch; the batches equal the in-process
    ones (workers=0) in every epoch, also after an epoch left half-way, and a start mid-epoch is the
    uninterrupted epoch's tail. The default worker count is the process's cores."""
    from repmlp_testdata import make_image_folder

    root = make_image_folder(tmp_path / "folder", classes=2, per_class=6, size=20)
    cfg = dict(dataset="imagefolder", data_dir=str(root), batch_size=3, img_size=16, flip=True, seed=5)
    assert DataConfig().workers is None and default_workers() == len(os.sched_getaffinity(0))

    def epochs(workers: int) -> tuple[list[list[torch.Tensor]], set[int]]:
        train = build_data(DataConfig(**cfg, workers=workers)).train
        assert train.workers == workers
        seen, pids = [], set()
        for epoch in range(3):
            if epoch == 1:  # leave an epoch after one batch: the next one starts afresh
                next(train.batches(epoch))
            seen.append([x for x, _ in train.batches(epoch)])
            seen.append([x for x, _ in train.batches(epoch, start=2)])
            if workers:
                pids |= {w.pid for w in train._loader._iterator._workers}
        return seen, pids

    inline, _ = epochs(0)
    workers, pids = epochs(2)
    assert len(pids) == 2  # the same two processes served all epochs
    for a, b in zip(inline, workers, strict=True):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for epoch in range(3):
        full, tail = inline[2 * epoch], inline[2 * epoch + 1]
        assert len(full) == 4 and all(torch.equal(x, y) for x, y in zip(full[2:], tail, strict=True))
    assert not torch.equal(inline[0][0], inline[2][0])  # epochs differ
