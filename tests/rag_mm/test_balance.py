"""Answer balancing (``data.balance_answers``): the training stream draws each question text's
answers more evenly, the same samples on a resumed stream, and evaluation streams are untouched."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from rag_mm.build import make_stream
from rag_mm.config import ConfigError, TrainConfig, validate
from rag_mm.data.balance import answer_balance, keep_probabilities
from rag_mm.data.pipeline import StreamSpec, make_loader


def _png(shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (shade, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def skewed(tmp_path_factory) -> list[str]:
    """Two shards, 200 samples: "is it red?" answered no 80 times and yes 20 times (the skew
    balancing removes), "what colour is it?" red / blue 50 each (already even)."""
    root = tmp_path_factory.mktemp("skewed")
    rows = [("Is it red?", "no")] * 80 + [("Is it red?", "yes")] * 20
    rows += [("What colour is it?", c) for c in ("red", "blue") * 50]
    urls = []
    for s in range(2):
        path = root / f"train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i, (q, a) in enumerate(rows[s::2]):
                key = f"s{s}q{i:04d}"
                sink.write(
                    {"__key__": key, "txt": q, "json": json.dumps({"answer": a}), "png": _png(i)}
                )
        urls.append(str(path))
    return urls


def _spec(urls, **kw) -> StreamSpec:
    base = dict(urls=urls, image_size=8, max_question=8, max_answer=4, batch_size=10)
    return StreamSpec(**(base | kw))


def _answers(spec: StreamSpec, batches: int) -> Counter:
    it = iter(make_loader(spec, 0))
    out = Counter()
    for _ in range(batches):
        b = next(it)
        out.update(zip(b["question"], b["answer"], strict=True))
    return out


def test_keep_probabilities_smooth_counts_to_the_power_one_minus_beta():
    counts = {"is it red": Counter(no=80, yes=20), "what colour": Counter(red=5, blue=5)}
    assert keep_probabilities(counts, 1.0) == {"is it red": {"no": 0.25, "yes": 1.0}}
    half = keep_probabilities(counts, 0.5)["is it red"]
    # kept counts 80 * 0.5 = 40 and 20: the ratio 4:1 becomes 2:1 = sqrt(4):1
    assert half["no"] == pytest.approx(0.5) and half["yes"] == 1.0
    assert keep_probabilities(counts, 0.0) == {}


def test_balanced_stream_draws_the_answers_of_a_question_evenly(skewed):
    rule = answer_balance(skewed, 1.0, seed=0)
    assert rule is not None and rule.kept_share == pytest.approx((20 + 20 + 100) / 200)
    plain = _answers(_spec(skewed), 60)
    balanced = _answers(_spec(skewed, keep=rule), 60)
    red = "Is it red?"
    assert plain[(red, "no")] / plain[(red, "yes")] == pytest.approx(4.0, rel=0.15)
    # 3 passes' worth of the 140 kept a pass: yes and no within sampling error of 1:1
    assert balanced[(red, "no")] / balanced[(red, "yes")] == pytest.approx(1.0, abs=0.35)
    # the even question keeps every sample, its answers as even as before
    colour = "What colour is it?"
    assert balanced[(colour, "red")] == pytest.approx(balanced[(colour, "blue")], rel=0.2)
    # kept: 140 of a pass's 200, all 100 of the even question among them
    assert balanced[(colour, "red")] + balanced[(colour, "blue")] == pytest.approx(
        600 * 100 / 140, rel=0.1
    )


def test_balanced_stream_resumes_with_the_same_samples(skewed):
    rule = answer_balance(skewed, 1.0, seed=3)
    it = iter(make_loader(_spec(skewed, keep=rule, shuffle_buffer=16), 0))
    full = [next(it)["key"] for _ in range(30)]
    it2 = iter(make_loader(_spec(skewed, keep=rule, shuffle_buffer=16, skip_batches=17), 0))
    assert [next(it2)["key"] for _ in range(13)] == full[17:]
    # another seed drops other samples
    other = answer_balance(skewed, 1.0, seed=4)
    it3 = iter(make_loader(_spec(skewed, keep=other, shuffle_buffer=16), 0))
    assert [next(it3)["key"] for _ in range(30)] != full


def test_make_stream_balances_training_only_and_the_config_is_checked(skewed):
    root = str(Path(skewed[0]).parent)
    cfg = TrainConfig()
    cfg.data.root, cfg.data.train, cfg.data.val = (
        root,
        "train-{000000..000001}.tar",
        "train-000000.tar",
    )
    cfg.model.image_size, cfg.data.batch_size, cfg.data.eval_batch_size = 8, 10, 10
    cfg.data.balance_answers = 1.0
    cfg.data.num_workers = 0
    assert make_stream(cfg, "train", True).spec.keep is not None
    assert make_stream(cfg, "val", False).spec.keep is None
    # the SimCLR warm-up reads pictures, not answers: its stream keeps every sample
    assert make_stream(cfg, "train", True, balance=False).spec.keep is None
    cfg.data.balance_answers = 0.0
    assert make_stream(cfg, "train", True).spec.keep is None
    cfg.data.balance_answers = 1.5
    with pytest.raises(ConfigError, match="data.balance_answers"):
        validate(cfg)
