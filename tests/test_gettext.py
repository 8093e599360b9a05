"""The gettext English→German corpus and its tokenizer, on small .mo files written here.

No test reads the machine's own catalogues: each writes its .mo files with ``write_mo`` below (the
GNU format: magic, revision, count, two offset tables, NUL-terminated strings) into a temporary
locale folder.
"""

from __future__ import annotations

import gettext
import json
import struct
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.data.gettext import (
    SPLITS,
    MoFormatError,
    NoCatalogueError,
    assign_splits,
    build_corpus,
    find_catalogues,
    load_pairs,
    parse_mo,
    read_catalogue,
    write_corpus,
)

HEADER = ("Project-Id-Version: demo 1.0\nContent-Type: text/plain; charset={charset}\n"
          "Plural-Forms: nplurals=2; plural=(n != 1);\n")


def write_mo(path: Path, messages: list[dict], charset: str = "UTF-8", big_endian: bool = False,
             header_extra: str = "") -> Path:
    """A .mo file of ``messages`` ({msgid, msgstr | msgstr_plural list, msgctxt?, msgid_plural?}),
    with a header entry declaring ``charset``; strings encoded with that charset."""
    entries = [(b"", (HEADER.format(charset=charset) + header_extra).encode(charset))]
    for m in messages:
        original = m["msgid"]
        if "msgid_plural" in m:
            original += "\x00" + m["msgid_plural"]
        if "msgctxt" in m:
            original = m["msgctxt"] + "\x04" + original
        translation = "\x00".join(m["msgstr_plural"]) if "msgstr_plural" in m else m["msgstr"]
        entries.append((original.encode(charset), translation.encode(charset)))
    entries.sort()
    order = ">" if big_endian else "<"
    n = len(entries)
    originals_at, translations_at = 28, 28 + 8 * n
    data_at = 28 + 16 * n
    blob, tables = b"", {"o": b"", "t": b""}
    for kind, index in (("o", 0), ("t", 1)):
        for entry in entries:
            s = entry[index]
            tables[kind] += struct.pack(order + "2I", len(s), data_at + len(blob))
            blob += s + b"\x00"
    head = struct.pack(order + "7I", 0x950412DE, 0, n, originals_at, translations_at, 0, data_at)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + tables["o"] + tables["t"] + blob)
    return path


MESSAGES = [
    {"msgid": "Cannot open %s: %s\n", "msgstr": "%s kann nicht geöffnet werden: %s\n"},
    {"msgid": "%d file", "msgid_plural": "%d files", "msgstr_plural": ["%d Datei", "%d Dateien"]},
    {"msgctxt": "menu", "msgid": "_Open", "msgstr": "Ö_ffnen"},
    {"msgctxt": "verb", "msgid": "Print", "msgstr": "Drucken"},
    {"msgid": "Copy {0} to {name}", "msgstr": "{0} nach {name} kopieren"},
    {"msgid": "Untranslated", "msgstr": ""},
    {"msgid": "&Quit", "msgstr": "&Beenden"},
    {"msgid": "%1$s of %2$s", "msgstr": "%1$s von %2$s"},
]


def test_parse_mo_splits_plurals_strips_context_and_keeps_markers(tmp_path):
    cat = read_catalogue(write_mo(tmp_path / "de/LC_MESSAGES/demo.mo", MESSAGES))
    pairs = {(p.src, p.tgt) for p in cat.pairs}
    assert pairs == {
        ("Cannot open %s: %s\n", "%s kann nicht geöffnet werden: %s\n"),
        ("%d file", "%d Datei"),
        ("%d files", "%d Dateien"),
        ("_Open", "Ö_ffnen"),
        ("Print", "Drucken"),
        ("Copy {0} to {name}", "{0} nach {name} kopieren"),
        ("&Quit", "&Beenden"),
        ("%1$s of %2$s", "%1$s von %2$s"),
    }
    assert all(p.catalogue == "demo" for p in cat.pairs)
    assert cat.skipped_empty == 1 and cat.charset == "UTF-8" and cat.locale == "de"


def test_parser_agrees_with_the_standard_library_on_utf8(tmp_path):
    """gettext.GNUTranslations is an independent reader of the same file (UTF-8 header)."""
    path = write_mo(tmp_path / "demo.mo", MESSAGES)
    with path.open("rb") as f:
        catalog = gettext.GNUTranslations(f)._catalog
    ours = {}
    for e in parse_mo(path.read_bytes()).entries:
        key = e.msgid if e.context is None else f"{e.context}\x04{e.msgid}"
        if e.msgid_plural is None:
            ours[key] = e.msgstr[0]
        else:
            ours.update({(key, i): s for i, s in enumerate(e.msgstr)})
    assert ours == catalog


def test_latin1_catalogue_with_a_latin1_header_is_decoded(tmp_path):
    """A header in ISO-8859-1 with a non-ASCII name (as net-tools ships) is read with its charset."""
    messages = [{"msgid": "Size", "msgstr": "Größe"}, {"msgid": "Mode", "msgstr": "Modus für Übertragung"}]
    path = write_mo(tmp_path / "de/LC_MESSAGES/old.mo", messages, charset="ISO-8859-1",
                    header_extra="Last-Translator: Ralf Bächle <r@example.org>\n")
    assert "ö".encode("iso-8859-1") in path.read_bytes() and "ö".encode() not in path.read_bytes()
    cat = read_catalogue(path)
    assert cat.charset == "ISO-8859-1"
    assert {(p.src, p.tgt) for p in cat.pairs} == {("Size", "Größe"), ("Mode", "Modus für Übertragung")}


def test_big_endian_file_reads_the_same(tmp_path):
    little = parse_mo(write_mo(tmp_path / "le.mo", MESSAGES).read_bytes())
    big = parse_mo(write_mo(tmp_path / "be.mo", MESSAGES, big_endian=True).read_bytes())
    assert little == big


def test_not_a_mo_file_is_refused(tmp_path):
    with pytest.raises(MoFormatError, match="magic"):
        parse_mo(b"msgid \"x\"\nmsgstr \"y\"\n" * 3)


def _locale(tmp_path: Path, n_catalogues: int = 40, per: int = 10) -> Path:
    """A locale folder: ``n_catalogues`` German catalogues of ``per`` unique messages each, plus
    one message every catalogue shares ("Cancel") and one duplicated twice inside a catalogue;
    a de_CH variant of the first domain (must be ignored) and a French catalogue (ignored)."""
    root = tmp_path / "locale"
    for c in range(n_catalogues):
        msgs = [{"msgid": f"Message {c}-{i} with %s", "msgstr": f"Meldung {c}-{i} mit %s"} for i in range(per)]
        msgs.append({"msgid": "Cancel", "msgstr": "Abbrechen"})
        msgs.append({"msgctxt": "button", "msgid": f"Message {c}-0 with %s", "msgstr": f"Meldung {c}-0 mit %s"})
        write_mo(root / f"de/LC_MESSAGES/dom{c}.mo", msgs)
    write_mo(root / "de_CH/LC_MESSAGES/dom0.mo", [{"msgid": "Street", "msgstr": "Strasse"}])
    write_mo(root / "de_CH/LC_MESSAGES/swiss.mo", [{"msgid": "Street", "msgstr": "Strasse"}])
    write_mo(root / "fr/LC_MESSAGES/dom1.mo", [{"msgid": "Cancel", "msgstr": "Annuler"}])
    return root


def test_one_catalogue_per_domain_prefers_plain_german(tmp_path):
    root = _locale(tmp_path, n_catalogues=3)
    paths = find_catalogues(root, "de")
    assert [p.stem for p in paths] == ["dom0", "dom1", "dom2", "swiss"]
    assert paths[0].parent.parent.name == "de" and paths[-1].parent.parent.name == "de_CH"


def test_corpus_split_never_shares_a_catalogue_and_is_deduplicated(tmp_path):
    root = _locale(tmp_path)
    corpus = build_corpus(root, "de")
    again = build_corpus(root, "de")
    assert corpus.splits == again.splits  # deterministic
    cats = {s: {p.catalogue for p in corpus.splits[s]} for s in SPLITS}
    assert all(corpus.splits[s] for s in SPLITS)
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not cats[a] & cats[b] and not set(corpus.catalogues[a]) & set(corpus.catalogues[b])
    for s in SPLITS:  # no pair twice in a split
        keys = [(p.src, p.tgt) for p in corpus.splits[s]]
        assert len(keys) == len(set(keys))
    train_src = {p.src for p in corpus.splits["train"]}
    assert not train_src & {p.src for s in ("validation", "test") for p in corpus.splits[s]}
    assert not {p.src for p in corpus.splits["validation"]} & {p.src for p in corpus.splits["test"]}
    assert "Cancel" in train_src and all(p.tgt != "Strasse" or p.catalogue == "swiss" for s in SPLITS
                                         for p in corpus.splits[s])
    all_pairs = sum(len(v) for v in corpus.splits.values())
    # 40 x 10 unique + Cancel once (in train) + Street once (the context duplicates are the same pairs)
    assert all_pairs == 40 * 10 + 1 + 1
    assert corpus.dropped["duplicate in split"] > 0 and corpus.dropped["source seen in train"] > 0


def test_assign_splits_fills_held_out_shares_by_pair_count():
    sizes = {f"cat{i}": 10 + (i * 37) % 200 for i in range(120)}
    where = assign_splits(sizes)
    total = sum(sizes.values())
    for split, share in (("test", 0.05), ("validation", 0.05)):
        count = sum(n for c, n in sizes.items() if where[c] == split)
        assert 0.03 * total <= count <= share * total
    assert assign_splits(dict(reversed(list(sizes.items())))) == where  # order of the input does not matter


def test_write_and_load_round_trip_with_a_data_card(tmp_path):
    corpus = build_corpus(_locale(tmp_path), "de")
    out = write_corpus(corpus, tmp_path / "corpus")
    for s in SPLITS:
        assert load_pairs(out, s) == corpus.splits[s]
        first = json.loads((out / f"{s}.jsonl").read_text(encoding="utf-8").splitlines()[0])
        assert set(first) == {"src", "tgt", "catalogue"}
    card = (out / "CARD.md").read_text(encoding="utf-8")
    n_train = len(corpus.splits["train"])
    assert f"| train | {len({p.catalogue for p in corpus.splits['train']})} | {n_train} |" in card


def test_missing_catalogue_is_a_clear_error_and_exit_2(tmp_path, capsys):
    (tmp_path / "locale/fr/LC_MESSAGES").mkdir(parents=True)
    with pytest.raises(NoCatalogueError, match="no 'de' gettext catalogue"):
        build_corpus(tmp_path / "locale", "de")
    status = main(["data", "gettext", "--out", str(tmp_path / "out"), "--locale-dir", str(tmp_path / "locale")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "no 'de' gettext catalogue" in err and "--locale-dir" in err
    assert not (tmp_path / "out").exists()


def test_cli_writes_the_corpus(tmp_path, capsys):
    status = main(["data", "gettext", "--out", str(tmp_path / "out"), "--locale-dir", str(_locale(tmp_path, 12))])
    assert status == 0
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"train.jsonl", "validation.jsonl", "test.jsonl",
                                                              "CARD.md"}
    assert "train:" in capsys.readouterr().out


def test_translation_tokenizer_round_trips_and_has_marian_specials(tmp_path):
    from transformers import AutoTokenizer

    from specdec.data.seq2seq_tokenizer import train_seq2seq_tokenizer

    corpus = build_corpus(_locale(tmp_path, 12), "de")
    texts = [t for p in corpus.splits["train"] for t in (p.src, p.tgt)]
    train_seq2seq_tokenizer(texts, vocab_size=400).save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    for text in ["Kann %1$s nicht öffnen: {name}\n", "  &Beenden _Datei ß€ 日本 ", "%d files"]:
        ids = tok(text)["input_ids"]
        assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok(text_target=text)["input_ids"] == ids
