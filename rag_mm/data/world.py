"""The knowledge world: entities with a drawn appearance and random facts.

Everything here is deterministic given a seed. Facts are drawn independently of appearance, so
no model can infer them from a picture: only a document that states them can answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Appearance vocabulary. Every look must stay identifiable from a query picture, so looks that
# only differ invisibly are drawn once: a solid body shows no secondary hue, and stripes or checks
# of hues (a, b) look like those of (b, a) shifted by one period. Distinct looks:
# 8 shapes x (8 solid + 28 striped + 28 checked + 56 dotted) = 960, far more than the few hundred
# entities the demo uses.
# Silhouettes that stay apart at 32 px under the query jitter (a hexagon there is a blurred circle).
SHAPES = ("circle", "square", "triangle", "diamond", "crescent", "star", "cross", "ring")
HUES = {  # well-separated RGB colours so colour jitter never moves one onto another
    "red": (220, 40, 40),
    "orange": (240, 140, 20),
    "yellow": (230, 220, 30),
    "green": (40, 170, 60),
    "cyan": (30, 200, 210),
    "blue": (40, 70, 220),
    "purple": (150, 50, 200),
    "black": (25, 25, 25),
}
TEXTURES = ("solid", "stripes", "dots", "checker")

# Facts: every value is a single token of open_clip's BPE, so answers are one token plus EOT.
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "habitat": ("forest", "desert", "ocean", "mountain", "swamp", "tundra", "cave", "river"),
    "diet": ("fish", "berries", "insects", "seeds", "leaves", "roots", "mice", "honey"),
    "season": ("spring", "summer", "autumn", "winter", "dawn", "dusk", "night", "noon"),
    "region": ("north", "south", "east", "west", "island", "valley", "lake", "canyon"),
}
# Several phrasings per attribute so the reader must map a question to the fact it asks for.
QUESTIONS: dict[str, tuple[str, ...]] = {
    "habitat": (
        "where does this creature live?",
        "what is the habitat of this creature?",
        "in which place is this creature found?",
    ),
    "diet": (
        "what does this creature eat?",
        "what is the diet of this creature?",
        "which food does this creature like?",
    ),
    "season": (
        "when is this creature active?",
        "in which season is this creature awake?",
        "at what time does this creature come out?",
    ),
    "region": (
        "which region does this creature come from?",
        "what is the home region of this creature?",
        "from where does this creature originate?",
    ),
    # The name is no fact with a value set: each creature has its own, made of syllables, so a
    # held-out creature's name was never a training answer and only copying it from the passage
    # answers the question.
    "name": (
        "what is this creature called?",
        "what is the name of this creature?",
        "which name does this creature go by?",
    ),
}
# Every kind of question a query asks: the four facts, then the name.
KINDS: tuple[str, ...] = (*ATTRIBUTES, "name")
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ru",
    "ze",
    "po",
    "ta",
    "vi",
    "nu",
    "sha",
    "gri",
    "bel",
    "dor",
    "fen",
    "quo",
    "xa",
)


@dataclass(frozen=True)
class Entity:
    """One creature of the world: its document id, name, appearance and facts."""

    doc_id: int
    name: str
    shape: str
    hue: str
    texture: str
    hue2: str
    facts: dict[str, str]

    def passage(self) -> str:
        """The document text: every fact, in a fixed order, then the name."""
        parts = [f"{attr}: {self.facts[attr]}." for attr in ATTRIBUTES]
        return " ".join(parts) + f" name: {self.name}."


def _visible(hue: str, texture: str, hue2: str) -> bool:
    """Whether (hue, texture, hue2) is the one representative of its visible look (see above)."""
    order = list(HUES)
    if texture == "solid":
        return hue2 == hue
    if texture in ("stripes", "checker"):  # symmetric patterns: the unordered pair of hues
        return order.index(hue) < order.index(hue2)
    return hue2 != hue  # dots of hue2 on a hue body differ from dots of hue on a hue2 body


def make_entities(num_entities: int, seed: int) -> list[Entity]:
    """Draw ``num_entities`` entities with distinct appearances and independent random facts."""
    looks = [
        (s, h, t, h2)
        for s in SHAPES
        for h in HUES
        for t in TEXTURES
        for h2 in HUES
        if _visible(h, t, h2)
    ]
    if num_entities > len(looks):
        raise ValueError(
            f"num_entities={num_entities} exceeds the {len(looks)} distinct appearances"
        )
    rng = random.Random(seed)
    rng.shuffle(looks)
    names: set[str] = set()
    out = []
    for i in range(num_entities):
        while True:
            name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
            if name not in names:
                names.add(name)
                break
        facts = {attr: rng.choice(values) for attr, values in ATTRIBUTES.items()}
        s, h, t, h2 = looks[i]
        out.append(Entity(i, name, s, h, t, h2, facts))
    return out


def answer(entity: Entity, kind: str) -> str:
    """The answer to a question of ``kind`` (an attribute or "name") about ``entity``."""
    return entity.name if kind == "name" else entity.facts[kind]


def chance_accuracy(names: bool = False) -> float:
    """Exact-match accuracy of guessing, the mean over question kinds: 1 / number of values for a
    fact, 0 for the name (every creature has its own) when name questions are asked."""
    return sum(1.0 / len(v) for v in ATTRIBUTES.values()) / (
        len(KINDS) if names else len(ATTRIBUTES)
    )
