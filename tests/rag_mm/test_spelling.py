"""An answer comes out as the passage wrote it. CLIP's BPE ends every digit and every run of
letters with a word end, so a code point "1F62F" decodes as "1 f 6 2 f"; the answer ids found as a
run of tokens in a passage the reader read are spelled as that passage spells them. Decoding joins
the digits of a number again ("13.0", not "1 3 . 0"), which numeric scoring parses."""

from __future__ import annotations

from rag_mm.data.tokenizer import Tokenizer, get_tokenizer

PASSAGE = (
    "Hushed Face. Short name: hushed. Code point 1F62F. Category: Smileys & Emotion. "
    "Unicode version 13.0. Served au café."
)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text) + [tok.eot_id]  # a generated answer ends with the end of text


def test_decoding_joins_numbers():
    tok = Tokenizer()
    assert tok.decode(tok.encode("13.0")) == "13.0"
    assert tok.decode(tok.encode("1,024 or 0.6")) == "1,024 or 0.6"
    assert tok.decode(tok.encode("version 6 . 0 of 2 apples")) == "version 6.0 of 2 apples"
    assert tok.decode(tok.encode("t-shirt")) == "t - shirt"  # not a number: left as decoded


def test_a_copied_answer_is_spelled_as_its_passage_writes_it():
    tok = Tokenizer()
    question = "What is the code point of this emoji?"
    for answer, spelled in [
        ("1f62f", "1F62F"),
        ("13.0", "13.0"),
        ("smileys & emotion", "Smileys & Emotion"),
        ("hushed face", "Hushed Face"),
        ("café", "café"),
    ]:
        assert tok.spell(_ids(tok, answer), [PASSAGE, question]) == spelled, answer
    # not in any source: decoded
    assert tok.spell(_ids(tok, "1f600"), [PASSAGE, question]) == "1 f 600"
    assert tok.spell(_ids(tok, "1f62f"), []) == "1 f 62 f"
    # the first source that holds the run wins (the passages nearest first)
    assert tok.spell(_ids(tok, "1f62f"), ["code 1f62f", PASSAGE]) == "1f62f"
    # a source whose lower case changes its length (spans would drift) is passed over
    assert tok.spell(_ids(tok, "1f62f"), ["İstanbul 1F62F", PASSAGE]) == "1F62F"


def _byte_level_bpe(path) -> None:
    """A byte-level BPE tokenizer trained here on a few lines, saved with save_pretrained."""
    from tokenizers import Tokenizer as Core
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Core(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator([PASSAGE] * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(path)


def test_a_hugging_face_tokenizer_spells_from_its_offsets(tmp_path):
    _byte_level_bpe(tmp_path)
    tok = get_tokenizer(str(tmp_path))
    ids = tok.encode(PASSAGE)
    read = tok.spans(PASSAGE)
    assert read is not None and read[1] == ids
    # the ids of " 1F62F" as the passage holds them, then the end of sequence
    start = PASSAGE.index(" 1F62F")
    run = [i for i, (a, b) in zip(ids, read[2]) if a >= start and b <= start + 6]
    assert tok.spell(run + [tok.eot_id], ["nothing here", PASSAGE]) == "1F62F"
    assert tok.spell([tok.eot_id], [PASSAGE]) == ""
