"""`aiayn translate` found wrong by a cold review (session 55). Each test failed before its fix."""

from aiayn.tokenizer import Tokenizer
from aiayn.translate import split_coded, with_target_token


class _Coded:
    """What `split_coded` and `with_target_token` ask of a multilingual model's source tokenizer."""

    language_codes = {">>fr<<": 7, ">>de<<": 8}
    language_code = Tokenizer.language_code


def test_split_sentences_with_a_target_language_keeps_the_lines_leading_spaces():
    """--split-sentences joins a line's translations with the line's own spacing; with --tgt-lang (or
    a >>xx<< token of the line's own) the spaces the line began with were dropped with the token's."""
    tok = _Coded()
    line = "  Ein Mann läuft. Der Hund spielt."
    plain = split_coded(tok, line, "de")
    assert plain.lead == "  "
    coded = split_coded(tok, with_target_token([line], ">>fr<<", tok)[0], "de")
    assert coded.lead == "  " and coded.gaps == plain.gaps
    assert coded.sentences == (">>fr<< Ein Mann läuft.", ">>fr<< Der Hund spielt.")
    own = split_coded(tok, ">>de<< Ein Kind.", "de")  # the one space after a line's own token is no layout
    assert own.lead == "" and own.sentences == (">>de<< Ein Kind.",)
