"""``scripts/emoji_kvqa.py``: knowledge-VQA sets from the ``emoji-datasource-<vendor>`` npm
packages, on fixtures in their published layout (``emoji.json``, ``img/<vendor>/64/<image>``)
and, for the flags, ``world-countries``' ``countries.json``."""

import importlib.util
import io
import json
import tarfile
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENDORS = ("google", "apple", "twitter", "facebook")


def _script():
    spec = importlib.util.spec_from_file_location("emoji_kvqa", ROOT / "scripts" / "emoji_kvqa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _emoji(unified: str, name: str, short: str, category: str, subcategory: str) -> dict:
    """One ``emoji.json`` record with the published fields (emoji-datasource 16.0.0)."""
    return {
        "name": name,
        "unified": unified,
        "non_qualified": None,
        "docomo": None,
        "au": None,
        "softbank": None,
        "google": None,
        "image": f"{unified.lower()}.png",
        "sheet_x": 0,
        "sheet_y": 0,
        "short_name": short,
        "short_names": [short],
        "text": None,
        "texts": None,
        "category": category,
        "subcategory": subcategory,
        "sort_order": 0,
        "added_in": "2.0",
        **{f"has_img_{v}": True for v in VENDORS},
    }


def _flag(letters: str, name: str) -> dict:
    unified = "-".join(f"{0x1F1E6 + ord(c) - ord('A'):X}" for c in letters)
    return _emoji(unified, f"{name} Flag", f"flag-{letters.lower()}", "Flags", "country-flag")


ENTRIES = [
    _flag("FR", "France"),
    _flag("MF", "St. Martin"),  # drawn as France's flag: left out
    _flag("US", "United States"),
    _flag("AQ", "Antarctica"),  # no capital: left out
    _flag("EU", "European Union"),  # no country: left out
    _flag("DE", "Germany"),
    _flag("JP", "Japan"),
    _flag("IT", "Italy"),
    _emoji("1F600", "GRINNING FACE", "grinning", "Smileys & Emotion", "face-smiling"),
    _emoji("1F431", "CAT FACE", "smiley_cat", "Animals & Nature", "animal-mammal"),
    _emoji("1F3FB", "EMOJI MODIFIER FITZPATRICK TYPE-1-2", "skin-tone-2", "Component", "skin-tone"),
    _emoji("1F468-200D-1F469-200D-1F467", "FAMILY", "man-woman-girl", "People & Body", "family"),
]


def _country(
    cca2: str,
    cca3: str,
    name: str,
    capital: list,
    root: str,
    suffixes: list,
    subregion: str,
    currency: dict,
) -> dict:
    """One ``countries.json`` record of world-countries 5.1.0 (the fields it publishes)."""
    return {
        "name": {"common": name, "official": name, "native": {}},
        "tld": [f".{cca2.lower()}"],
        "cca2": cca2,
        "ccn3": "000",
        "cca3": cca3,
        "cioc": cca3,
        "independent": True,
        "status": "officially-assigned",
        "unMember": True,
        "currencies": currency,
        "idd": {"root": root, "suffixes": suffixes},
        "capital": capital,
        "altSpellings": [cca2],
        "region": "Europe",
        "subregion": subregion,
        "languages": {},
        "translations": {},
        "latlng": [0, 0],
        "landlocked": False,
        "borders": [],
        "area": 1.0,
        "flag": "",
        "demonyms": {},
    }


EURO = {"EUR": {"name": "Euro", "symbol": "€"}}
COUNTRIES = [
    _country("FR", "FRA", "France", ["Paris"], "+3", ["3"], "Western Europe", EURO),
    _country("MF", "MAF", "Saint Martin", ["Marigot"], "+5", ["90"], "Caribbean", EURO),
    _country(
        "US",
        "USA",
        "United States",
        ["Washington D.C."],
        "+1",
        ["201", "202"],
        "North America",
        {"USD": {"name": "United States dollar", "symbol": "$"}},
    ),
    _country("AQ", "ATA", "Antarctica", [], "", [], "", {}),
    _country("DE", "DEU", "Germany", ["Berlin"], "+4", ["9"], "Western Europe", EURO),
    _country(
        "JP",
        "JPN",
        "Japan",
        ["Tokyo"],
        "+8",
        ["1"],
        "Eastern Asia",
        {"JPY": {"name": "Japanese yen", "symbol": "¥"}},
    ),
    _country("IT", "ITA", "Italy", ["Rome"], "+3", ["9"], "Southern Europe", EURO),
]


def _packages(root: Path) -> Path:
    """Unpacked packages whose picture of entry ``i`` by vendor ``j`` is filled with the grey
    level ``20 * i + j`` (Saint Martin's is France's), so a written picture names its source."""
    from PIL import Image

    for j, vendor in enumerate(VENDORS):
        pkg = root / f"emoji-datasource-{vendor}" / "package"
        (pkg / "img" / vendor / "64").mkdir(parents=True)
        (pkg / "emoji.json").write_text(json.dumps(ENTRIES))
        (pkg / "package.json").write_text(json.dumps({"version": "16.0.0"}))
        for i, e in enumerate(ENTRIES):
            level = 20 * (0 if e["short_name"] == "flag-mf" else i) + j
            Image.new("RGBA", (64, 64), (level, level, level, 255)).save(
                pkg / "img" / vendor / "64" / e["image"]
            )
    (root / "countries.json").write_text(json.dumps(COUNTRIES))
    return root


def _read(shard_dir: Path) -> list[dict]:
    """Every sample of a split's shards: ``{"json", "txt", "png"}`` by key."""
    samples: dict[str, dict] = defaultdict(dict)
    for shard in sorted(shard_dir.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                samples[key][ext] = tar.extractfile(m).read()
    return list(samples.values())


def _grey(png: bytes) -> int:
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("L").getpixel((24, 24))


def test_flags_become_countries_with_their_facts_and_an_unseen_quarter(tmp_path, capsys):
    script = _script()
    pkgs = _packages(tmp_path / "pkgs")
    out = tmp_path / "flags"
    args = ["--packages", str(pkgs), "--out", str(out), "--entities", "flags"]
    args += ["--countries", str(pkgs / "countries.json"), "--heldout-fraction", "0.2"]
    assert script.main([*args, "--train-per-entity", "6", "--test-per-entity", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    # five countries: St. Martin (France's flag), Antarctica (no capital), the EU (no country)
    # and the emoji that are not flags are left out
    assert printed["corpus"] == 5
    docs = {json.loads(s["json"])["doc_id"]: s for s in _read(out / "corpus")}
    passages = {json.loads(s["json"])["name"]: s["txt"].decode() for s in docs.values()}
    assert passages["france"] == (
        "country: france. capital: paris. abbreviation: fra. calling code: +33. "
        "region: western europe. currency: euro."
    )
    assert "calling code: +1. " in passages["united states"]  # several suffixes: the root alone
    assert sorted(passages) == ["france", "germany", "italy", "japan", "united states"]
    # the memory holds Google's picture (vendor 0) of the entity the passage is about
    names = [e["name"] for e in ENTRIES]
    for s in docs.values():
        name = json.loads(s["json"])["name"]
        i = next(k for k, n in enumerate(names) if n.lower().startswith(name.split()[0]))
        assert _grey(s["png"]) == 20 * i
    world = json.loads((out / "world.json").read_text())
    heldout = set(world["heldout_doc_ids"])
    assert len(heldout) == 1 and world["kinds"] == list(script.FLAG_QUESTIONS)
    for split, per in (("train", 6), ("val", 2), ("test", 4)):
        queries = [(json.loads(s["json"]), s["txt"].decode()) for s in _read(out / split)]
        by_doc = defaultdict(int)
        for meta, question in queries:
            by_doc[meta["doc_id"]] += 1
            assert meta["heldout"] == (meta["doc_id"] in heldout)
            assert question in script.FLAG_QUESTIONS[meta["attribute"]]
            label = {
                "country": "country",
                "capital": "capital",
                "code": "abbreviation",
                "calling_code": "calling code",
                "region": "region",
            }[meta["attribute"]]
            passage = docs[meta["doc_id"]]["txt"].decode()
            assert f"{label}: {meta['answer']}." in passage
        expected = set(docs) - heldout if split == "train" else set(docs)
        assert by_doc == {d: per for d in expected}


def test_emoji_are_single_code_points_and_flags_need_their_countries(tmp_path, capsys):
    script = _script()
    pkgs = _packages(tmp_path / "pkgs")
    out = tmp_path / "emoji"
    assert script.main(["--packages", str(pkgs), "--out", str(out), "--heldout-fraction", "0"]) == 0
    capsys.readouterr()
    names = sorted(json.loads(s["json"])["name"] for s in _read(out / "corpus"))
    # flags and families are sequences, the skin tone a component
    assert names == ["cat face", "grinning face"]
    args = ["--packages", str(pkgs), "--out", str(tmp_path / "f"), "--entities", "flags"]
    assert script.main(args) == 2
    assert capsys.readouterr().err.strip() == (
        "emoji_kvqa: error: --entities flags needs --countries (world-countries' countries.json)"
    )
    (tmp_path / "not_countries.json").write_text(json.dumps({"FR": "France"}))
    assert script.main([*args, "--countries", str(tmp_path / "not_countries.json")]) == 2
    err = capsys.readouterr().err
    assert "not_countries.json is not world-countries' countries.json" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit):
        script.main([*args, "--entities", "animals"])
