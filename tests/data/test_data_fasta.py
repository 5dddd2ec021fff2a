"""FASTA reading: header styles, wrapped lines, compression, malformed input (FILE:LINE), skip counts, streaming."""

import gzip
from collections import Counter

import pytest
from tests.helpers.data_files import AA, DISPROT, ESM, EXTRA, MMSEQS, needs_disprot

from s2t2_dist.errors import DataFormatError
from s2t2_dist.data.fasta import read_fasta
from s2t2_dist.data.records import RecordFilter, RecordPolicy, read_raw


def strict(**kw):
    return RecordPolicy(alphabet=AA, extra_residues=EXTRA, **kw)


def read_all(path, policy, stats=None):
    filt = RecordFilter(policy, stats if stats is not None else Counter())
    out = []
    for rec in read_raw([str(path)], allowed=policy.allowed(), uppercase=policy.uppercase):
        kept = filt(rec)
        if kept is not None:
            out.append((kept.id, kept.text))
    return out


def naive_fasta(path):
    """Independent reference parser for well-formed files."""
    recs, cur, hdr = [], [], None
    for line in open(path):
        line = line.strip()
        if line.startswith(">"):
            if hdr is not None:
                recs.append((hdr, "".join(cur)))
            hdr, cur = line[1:].split()[0], []
        elif line:
            cur.append(line)
    if hdr is not None:
        recs.append((hdr, "".join(cur)))
    return recs


def test_header_styles_wrapped_lines_crlf_blank_lines(tmp_path):
    p = tmp_path / "mixed.fasta"
    p.write_bytes(
        b">UniRef50_A0A5A9P0L4 Peptidylprolyl isomerase n=1 Tax=Triplophysa tibetana TaxID=1572043 "
        b"RepID=A0A5A9P0L4_9TELE\r\nMKVLA\r\nGHIKL\r\n\r\n"
        b">UniRef50_A0A1E3NP16\nACDEF\nGH\n"
        b">tr|A7TBS3|A7TBS3_NEMVE Predicted protein (Fragment) OS=Nematostella vectensis\nVCIHT\n\n\n")
    recs = [(r.id, r.text, r.pos) for r in read_fasta(p, allowed=AA)]
    assert recs == [("UniRef50_A0A5A9P0L4", "MKVLAGHIKL", 1), ("UniRef50_A0A1E3NP16", "ACDEFGH", 5),
                    ("tr|A7TBS3|A7TBS3_NEMVE", "VCIHT", 8)]


@pytest.mark.parametrize("path,n", [(ESM, 15), (MMSEQS, 500), pytest.param(DISPROT, 1162, marks=needs_disprot)],
                         ids=["esm", "mmseqs2", "disprot"])
def test_real_files_match_reference_parser(path, n):
    got = read_all(path, strict())
    assert len(got) == n
    assert got == naive_fasta(path)
    if path == ESM:
        assert got[0][0].startswith("UniRef50_")
    if path == MMSEQS:
        assert got[0][0] == "tr|A7TBS3|A7TBS3_NEMVE"
    if path == DISPROT:
        assert max(len(s) for _, s in got) == 34350


def test_gzip_equals_plain_and_is_detected_by_content(tmp_path):
    src = MMSEQS
    gz = tmp_path / "q.fasta.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    odd = tmp_path / "q_gz_without_suffix.fasta"  # gzip recognised by magic bytes, not the name
    odd.write_bytes(gz.read_bytes())
    plain = read_all(src, strict())
    assert read_all(gz, strict()) == plain
    assert read_all(odd, strict()) == plain


def test_sequence_before_header_names_file_and_line(tmp_path):
    p = tmp_path / "orphan.fasta"
    p.write_text("\nMKV\n>a\nACD\n")
    with pytest.raises(DataFormatError) as e:
        read_all(p, strict())
    assert str(e.value).startswith(f"{p}:2:")
    assert "before the first" in str(e.value)


def test_empty_record_names_its_header_line(tmp_path):
    p = tmp_path / "empty.fasta"
    p.write_text(">a\nACD\n>b desc\n>c\nKLM\n")
    with pytest.raises(DataFormatError, match=rf"^{p}:3: record 'b' has no sequence"):
        read_all(p, strict())


def test_empty_last_record(tmp_path):
    p = tmp_path / "empty_last.fasta"
    p.write_text(">a\nACD\n>b\n")
    with pytest.raises(DataFormatError, match=rf"^{p}:3:"):
        read_all(p, strict())


def test_bad_character_names_exact_line_and_column(tmp_path):
    p = tmp_path / "bad.fasta"
    p.write_text(">a\nACDEF\nGH*KL\n>b\nMKV\n")
    with pytest.raises(DataFormatError) as e:
        read_all(p, strict())
    msg = str(e.value)
    assert msg.startswith(f"{p}:3:") and "'*'" in msg and "column 3" in msg and "'a'" in msg


def test_lowercase_is_bad_unless_uppercase_policy(tmp_path):
    p = tmp_path / "lower.fasta"
    p.write_text(">a\nacdef\n")
    with pytest.raises(DataFormatError, match=rf"^{p}:2:"):
        read_all(p, strict())
    assert read_all(p, strict(uppercase=True)) == [("a", "ACDEF")]


def test_missing_id(tmp_path):
    p = tmp_path / "noid.fasta"
    p.write_text(">a\nACD\n>   \nKLM\n")
    with pytest.raises(DataFormatError, match=rf"^{p}:3: header line has no id"):
        read_all(p, strict())


def test_truncated_gzip_names_file_and_line_after_streaming_earlier_records(tmp_path):
    records = "".join(f">r{i}\n{'ACDEFGHIKL' * 30}\n" for i in range(2000))
    full = gzip.compress(records.encode())
    p = tmp_path / "cut.fasta.gz"
    p.write_bytes(full[: len(full) // 2])
    seen = []
    with pytest.raises(DataFormatError) as e:
        for rec in read_fasta(p, allowed=AA):
            seen.append(rec.id)
    msg = str(e.value)
    assert msg.startswith(f"{p}:") and "truncated" in msg
    line = int(msg[len(str(p)) + 1:].split(":")[0])
    assert line > 2
    # streaming: records before the damage were delivered before the error
    assert len(seen) > 10 and seen[:3] == ["r0", "r1", "r2"]


def test_truncated_gzip_is_an_error_even_when_skipping(tmp_path):
    full = gzip.compress(b">a\nACDEF\n" * 1000)
    p = tmp_path / "cut.fa.gz"
    p.write_bytes(full[:-10])
    with pytest.raises(DataFormatError, match="truncated"):
        read_all(p, strict(on_bad_record="skip"))


def test_skip_mode_counts_every_reason(tmp_path):
    p = tmp_path / "messy.fasta"
    p.write_text("MKV\n"             # sequence before header
                 ">ok1\nACDEF\n"
                 ">empty\n"           # empty record
                 ">bad\nAC1DE\n"      # bad character
                 ">\nKLM\n"           # missing id
                 ">ok2\nKLMNP\nQR\n"
                 ">short\nA\n")       # filtered by min_length
    stats = Counter()
    got = read_all(p, strict(on_bad_record="skip", min_length=2), stats)
    assert got == [("ok1", "ACDEF"), ("ok2", "KLMNPQR")]
    assert stats["read"] == 7 and stats["kept"] == 2
    assert stats["bad:sequence_before_header"] == 1
    assert stats["bad:empty_record"] == 1
    assert stats["bad:bad_character"] == 1
    assert stats["bad:missing_id"] == 1
    assert stats["filtered:too_short"] == 1
    # nothing dropped silently: every record read is accounted for
    assert stats["read"] == stats["kept"] + sum(v for k, v in stats.items() if k.startswith(("bad:", "filtered:")))


@needs_disprot
def test_extra_residue_policies_on_real_disprot_file():
    path = DISPROT
    ref = naive_fasta(path)
    with_extra = [r for r in ref if set(r[1]) & set(EXTRA)]
    n_extra = sum(sum(c in EXTRA for c in s) for _, s in ref)
    assert with_extra and n_extra == 4  # the file has 1 U and 3 X
    assert read_all(path, strict()) == ref  # keep
    st = Counter()
    assert len(read_all(path, strict(extra_residue_policy="skip"), st)) == len(ref) - len(with_extra)
    assert st["filtered:extra_residue"] == len(with_extra)
    st = Counter()
    rep = read_all(path, strict(extra_residue_policy="replace", replacement="X"), st)
    assert st["replaced_residues"] == sum(s.count("U") for _, s in ref)  # only U changes (X stays X)
    assert all("U" not in s for _, s in rep)
    with pytest.raises(DataFormatError, match=rf"^{path}:\d+: record .* contains"):
        read_all(path, strict(extra_residue_policy="error"))
    # the 20-letter alphabet alone rejects them as bad characters
    with pytest.raises(DataFormatError, match="not in the allowed alphabet"):
        read_all(path, RecordPolicy(alphabet=AA))


def test_length_filters(tmp_path):
    p = tmp_path / "len.fasta"
    p.write_text(">a\nAC\n>b\nACDEF\n>c\nACDEFGHIKL\n")
    st = Counter()
    assert read_all(p, strict(min_length=3, max_length=6), st) == [("b", "ACDEF")]
    assert st["filtered:too_short"] == 1 and st["filtered:too_long"] == 1
