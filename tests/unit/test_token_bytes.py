"""The bytes of a token from its vocabulary name (data/tokenizer.token_bytes), which logprobs report for tokens that
are parts of characters."""

from scalenlp.data.tokenizer import load_tokenizer, token_bytes
from scalenlp.engine.decoder_engine import Engine
from scalenlp.models.io import load_pretrained


def test_byte_level_names_give_the_bytes_the_tokens_decode_to(tiny_export):
    tok = load_tokenizer(tiny_export)
    whole = 0
    for token in range(tok.get_vocab_size()):
        text = tok.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text and not tok.id_to_token(token).startswith("<|"):
            assert token_bytes(tok.id_to_token(token)) == text.encode(), token
            whole += 1
    assert whole > tok.get_vocab_size() // 2
    ids = tok.encode("日本 naïve").ids  # characters split over tokens
    assert b"".join(token_bytes(tok.id_to_token(t)) for t in ids) == "日本 naïve".encode()


def test_byte_fallback_names_and_other_names():
    assert token_bytes("<0xE2>") == b"\xe2" and token_bytes("<0x0a>") == b"\n"
    assert token_bytes("\u2581the") is None and token_bytes("") is None  # SentencePiece's word start


def test_the_engine_writes_parts_of_characters_as_escaped_bytes(tiny_export):
    tok = load_tokenizer(tiny_export)
    engine = Engine(load_pretrained(tiny_export), tok, max_batch=1)
    parts = [t for t in tok.encode("日本").ids if "\ufffd" in tok.decode([t])]
    assert parts
    written = [engine.token_str(t) for t in parts]
    assert all(w.startswith("bytes:\\x") for w in written)
    assert b"".join(bytes.fromhex(w[6:].replace("\\x", "")) for w in written) == b"".join(
        token_bytes(tok.id_to_token(t)) for t in parts)
