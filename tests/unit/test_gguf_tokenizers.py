"""GGUF tokenizers other than GPT-2's byte-level BPE: SentencePiece vocabularies (tokenizer.ggml.model "llama":
Llama 2 / Mistral with the ▁ prefix, Gemma without it) and Llama 3's byte-level BPE split (pre "llama-bpe").
Each vocabulary is trained here, written as llama.cpp's converter writes it, read by scalenlp and compared, id for
id, with transformers' tokenizer of the same vocabulary (and SentencePiece's own) on a few hundred lines of real
text from ../shared/data, then decoded back."""

import io
import json
from pathlib import Path

import gguf
import pytest
import regex
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from scalenlp.data.tokenizer import find_bos_token_id, find_eos_token_id
from scalenlp.errors import UserError
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.gguf import PRE_TOKENIZERS, read_gguf, read_tokenizer, write_gguf

# Lines the data's own lines lack: runs of spaces, tabs, lone newlines, digits beside letters, symbols, emoji.
EDGES = ["", " ", "  two leading spaces", "trailing spaces   ", "\n", "\n\nafter blank lines\n", "tab\tand\t\ttabs",
         "日本語のテキスト 🤖🎉 ok", "3.14159, 1,000,000 and 2024-05-01T12:00", "don't I'M WE'LL you'd", "a  b   c    d",
         "naïve café — «quoted» ½ x² Ωmega", "CamelCase snake_case kebab-case URL: https://x.io/a?b=1"]
# Meta's Llama 3 tokenizer.json spells the contractions case-insensitively; llama.cpp spells each case out.
META_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA_CPP_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _lines(path: Path, start: int, count: int) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines()[start:] if line.strip()][:count]


@pytest.fixture(scope="module")
def data(shared_data) -> Path:
    """The data sets the lines and the training text come from (the test skips without them)."""
    needed = ["wikitext2/test.txt", "wikitext2/valid.txt", "tinyshakespeare/input.txt", "squad/dev.json",
              "wnut17/dev.conll", "sst2/dev.tsv"]
    missing = [name for name in needed if not (shared_data / name).is_file()]
    if missing:
        pytest.skip(f"{shared_data} lacks {', '.join(missing)}")
    return shared_data


@pytest.fixture(scope="module")
def lines(data) -> list[str]:
    """~400 lines of text none of the tokenizers trained on: WikiText (every line starts with a space; numbers as
    "1 @,@ 000"; its <unk> placeholder, which is Llama's unknown token, spelled <UNK> so as to stay text),
    Shakespeare, SQuAD paragraphs (accents, dashes, other scripts), WNUT tweets (emoji, URLs) and SST-2."""
    wiki = [line.replace("<unk>", "<UNK>") for line in _lines(data / "wikitext2" / "test.txt", 0, 120)]
    squad = json.loads((data / "squad" / "dev.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p["context"] for article in squad for p in article["paragraphs"]][:60]
    tweets = (data / "wnut17" / "dev.conll").read_text(encoding="utf-8").split("\n\n")[:60]
    tweets = [" ".join(row.split("\t")[0] for row in tweet.splitlines()) for tweet in tweets]
    sst = [row.split("\t", 1)[1] for row in _lines(data / "sst2" / "dev.tsv", 1, 60)]
    return wiki + _lines(data / "tinyshakespeare" / "input.txt", 30000, 100) + paragraphs + tweets + sst + EDGES


def _training_text(data: Path) -> list[str]:
    shakespeare = (data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:150_000]
    wiki = (data / "wikitext2" / "valid.txt").read_text(encoding="utf-8")[:150_000]
    return [line for line in (shakespeare + wiki).splitlines() if line.strip()]


def _sentencepiece(data: Path, folder: Path, **options) -> Path:
    """A SentencePiece BPE with byte fallback trained as Llama 2's was (no normalization, digits split, whitespace
    kept), saved as a transformers tokenizer folder's tokenizer.model."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_text(data)), model_writer=model, vocab_size=1000, model_type="bpe",
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=0.9995, num_threads=1, minloglevel=2, **options)
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return folder / "tokenizer.model"


def _write_tokenizer_gguf(path: Path, write) -> Path:
    """A GGUF file holding only a vocabulary (what read_tokenizer reads), its keys set by ``write(writer)``."""
    writer = gguf.GGUFWriter(path, "llama")
    write(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _sentencepiece_gguf(model: Path, path: Path, add_eos: bool = False) -> Path:
    """The SentencePiece vocabulary as llama.cpp's converter writes it: pieces, scores and piece types (GGUF's token
    types are SentencePiece's piece types), the special ids, add_bos, and the dummy prefix as add_space_prefix."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    sp = spm.SentencePieceProcessor(model_file=str(model))

    def write(writer):
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([p.piece for p in proto.pieces])
        writer.add_token_scores([p.score for p in proto.pieces])
        writer.add_token_types([p.type for p in proto.pieces])
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(add_eos)
        writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    return _write_tokenizer_gguf(path, write)


@pytest.fixture(scope="module")
def llama2(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("llama2")
    model = _sentencepiece(data, folder / "hf", unk_id=0, bos_id=1, eos_id=2)
    return model, _sentencepiece_gguf(model, folder / "llama2.gguf")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, data):
    """Gemma's layout: no dummy prefix, pad/eos/bos/unk at 0-3, turn markers as user-defined pieces."""
    folder = tmp_path_factory.mktemp("gemma")
    model = _sentencepiece(data, folder / "hf", add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                           pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                           user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
    return model, _sentencepiece_gguf(model, folder / "gemma.gguf")


def _parity(ours: Tokenizer, theirs, lines: list[str], quirk=lambda line: line) -> None:
    """Ours and transformers' give the same ids for every line (transformers' for ``quirk(line)``), and both decode
    ours back to the line."""
    for line in lines:
        ids = ours.encode(line, add_special_tokens=False).ids
        assert ids == theirs.encode(quirk(line), add_special_tokens=False), line
        assert ours.decode(ids, skip_special_tokens=False) == line
        assert theirs.decode(ids, clean_up_tokenization_spaces=False) == line


def _read_and_match_sentencepiece(model: Path, path: Path, lines: list[str], hf_class, **hf_options):
    """The file's tokenizer as scalenlp reads it (checked to give SentencePiece's ids on every line), its config,
    SentencePiece's own and transformers' (``hf_class``) tokenizer of the model."""
    tokenizer, config = read_tokenizer(path)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    for line in lines:
        assert tokenizer.encode(line, add_special_tokens=False).ids == sp.encode(line), line
    return tokenizer, config, sp, hf_class.from_pretrained(str(model.parent), **hf_options)


def test_llama2_sentencepiece_equals_sentencepiece_and_transformers(transformers, llama2, lines, tmp_path):
    tokenizer, config, sp, hf = _read_and_match_sentencepiece(*llama2, lines, transformers.LlamaTokenizer)
    assert config == {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    assert tokenizer.get_vocab() == hf.get_vocab()
    byte_fallback = sum(any(tokenizer.id_to_token(i).startswith("<0x") for i in tokenizer.encode(line).ids)
                        for line in lines)
    assert byte_fallback > 50  # the accents, other scripts and emoji the 1000 pieces lack come out as bytes
    # transformers' Metaspace adds no ▁ before a text that already starts with a space, where SentencePiece (and
    # llama.cpp) add one to any text: " a" is "▁▁a" here, "▁a" there; the same text with one more space agrees.
    _parity(tokenizer, hf, lines, quirk=lambda line: " " + line if line.startswith(" ") else line)
    # BOS starts every text, as add_bos_token says; EOS ends it where add_eos_token says so.
    assert tokenizer.encode("Hello").ids == [sp.bos_id(), *sp.encode("Hello")]
    with_eos, _ = read_tokenizer(_sentencepiece_gguf(llama2[0], tmp_path / "eos.gguf", add_eos=True))
    assert with_eos.encode("Hello").ids == [sp.bos_id(), *sp.encode("Hello"), sp.eos_id()]


def test_llama2_special_tokens_in_text_match_llama_cpp(transformers, llama2):
    """Control tokens written in the text are one token each, and the text after one starts with ▁ again, as in
    llama.cpp (and transformers' legacy Llama tokenizer, whose prefix comes back after every special token)."""
    tokenizer, _, sp, hf = _read_and_match_sentencepiece(*llama2, [], transformers.LlamaTokenizer, legacy=True)
    text = "<s>[INST] Who wrote Hamlet? [/INST] Shakespeare.</s><s>[INST] And when?</s>"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids[:2] == [sp.bos_id(), *sp.encode("[INST]")[:1]]  # "▁[" after <s>: the prefix restarts
    assert ids.count(sp.eos_id()) == 2 and ids.count(sp.bos_id()) == 2


def test_gemma_sentencepiece_without_prefix_space(transformers, gemma, lines):
    tokenizer, config, sp, hf = _read_and_match_sentencepiece(*gemma, lines, transformers.GemmaTokenizer)
    assert config == {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
    _parity(tokenizer, hf, lines)  # no prefix space, so no quirk either
    chat = "<start_of_turn>user\nWho wrote Hamlet?<end_of_turn>\n<start_of_turn>model\n"
    ids = tokenizer.encode(chat).ids
    assert ids == [sp.bos_id(), *sp.encode(chat)] == [sp.bos_id(), *hf.encode(chat, add_special_tokens=False)]
    assert ids.count(sp.piece_to_id("<start_of_turn>")) == 2  # user-defined pieces stay whole
    # Documents are marked with Gemma's own BOS and EOS even where no tokenizer config names them.
    assert (find_bos_token_id(tokenizer), find_eos_token_id(tokenizer)) == (sp.bos_id(), sp.eos_id())


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, data):
    """A byte-level BPE split by Llama 3's regex, trained here; its tokenizer.json (as Meta's is shaped) and the GGUF
    llama.cpp's converter writes from it (model gpt2, pre llama-bpe, merges, control tokens, add_bos)."""
    folder = tmp_path_factory.mktemp("llama3")
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(META_LLAMA3_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(_training_text(data), trainers.BpeTrainer(
        vocab_size=1000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A",
                                                             special_tokens=[(specials[0], 0)])
    tokenizer.save(str(folder / "tokenizer.json"))
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]

    def write(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("llama-bpe")
        writer.add_token_list([token for token, _ in vocab])
        writer.add_token_types([gguf.TokenType.CONTROL if token in specials else gguf.TokenType.NORMAL
                                for token, _ in vocab])
        writer.add_token_merges([" ".join(m) for m in merges])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_add_bos_token(True)
    return folder / "tokenizer.json", _write_tokenizer_gguf(folder / "llama3.gguf", write)


def test_llama3_split_equals_transformers_and_llama_cpp_regex(transformers, llama3, lines):
    tokenizer_json, path = llama3
    tokenizer, config = read_tokenizer(path)
    assert config == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), bos_token="<|begin_of_text|>",
                                 eos_token="<|end_of_text|>")
    for line in lines:
        assert tokenizer.encode(line).ids == hf.encode(line), line  # BOS first in both
        pieces = tokenizer.pre_tokenizer.pre_tokenize_str(line)
        assert [decoders.ByteLevel().decode([p]) for p, _ in pieces] == regex.findall(LLAMA_CPP_LLAMA3_REGEX, line)
    _parity(tokenizer, hf, lines)
    # Where GPT-2's split differs: digit runs cut by three, case-blind contractions, a space before a number alone.
    split = [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str("I'M 12345")]
    assert split == ["I", "'M", "Ġ", "123", "45"]
    for alias in ("llama3", "llama-v3"):
        assert [p for p, _ in PRE_TOKENIZERS[alias]().pre_tokenize_str("I'M 12345")] == split


def test_unsupported_tokenizers_are_one_line(tmp_path):
    def vocabulary(kind, **keys):
        def write(writer):
            writer.add_tokenizer_model(kind)
            writer.add_token_list(["<unk>", "a", "b", "ab"])
            for key, value in keys.items():
                getattr(writer, f"add_{key}")(value)
        return write

    with pytest.raises(UserError, match=r"tokenizer model 'bert' is not supported; supported: gpt2 .*, llama"):
        read_tokenizer(_write_tokenizer_gguf(tmp_path / "bert.gguf", vocabulary("bert")))
    with pytest.raises(UserError, match="needs tokenizer.ggml.scores, one per token"):
        read_tokenizer(_write_tokenizer_gguf(tmp_path / "noscores.gguf", vocabulary("llama")))
    with pytest.raises(UserError, match="pre-tokenization 'qwen2' is not supported; supported: gpt-2, smollm, "
                                        "llama-bpe"):
        read_tokenizer(_write_tokenizer_gguf(tmp_path / "qwen.gguf", vocabulary("gpt2", tokenizer_pre="qwen2")))


@pytest.mark.parametrize("kind", ["llama2", "gemma", "llama3"])
def test_written_back_by_write_gguf(request, kind, lines, tmp_path):
    """A tiny model with each file's vocabulary, written by write_gguf and read back whole by read_gguf: the same ids
    and config, and the token kinds llama.cpp needs (bytes, unknown, control, user-defined) as the file had them."""
    _, path = request.getfixturevalue(kind)
    tokenizer, config = read_tokenizer(path)
    args = ModelArgs(vocab_size=tokenizer.get_vocab_size(), dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=64)
    out = write_gguf(Transformer(args), tokenizer, config, tmp_path / f"{kind}.gguf", "f32")
    back = read_gguf(out)
    assert back.tokenizer_config == config
    for line in lines:
        assert back.tokenizer.encode(line).ids == tokenizer.encode(line).ids, line
    before, after = gguf.GGUFReader(path), gguf.GGUFReader(out)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.token_type", "tokenizer.ggml.add_space_prefix",
                "tokenizer.ggml.pre", "tokenizer.ggml.unknown_token_id"):
        if key != "tokenizer.ggml.pre" or kind == "llama3":  # SentencePiece files name no pre-tokenization
            assert _contents(after, key) == _contents(before, key), key


def _contents(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def test_transformers_reads_the_sentencepiece_file_we_write(transformers, llama2, lines, tmp_path):
    """transformers' own GGUF reader makes the same tokenizer of what write_gguf wrote (but for its Metaspace quirk)."""
    _, path = llama2
    tokenizer, config = read_tokenizer(path)
    args = ModelArgs(vocab_size=tokenizer.get_vocab_size(), dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=64)
    write_gguf(Transformer(args), tokenizer, config, tmp_path / "llama2.gguf", "f32")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="llama2.gguf")
    _parity(tokenizer, hf, lines, quirk=lambda line: " " + line if line.startswith(" ") else line)


def test_metaspace_tokenizer_is_not_written_as_llama_cpp_would_differ(transformers, llama2, tmp_path):
    """transformers' own Llama tokenizer (Metaspace: no ▁ added before a leading space) cannot be written as a
    llama.cpp vocabulary without changing its ids: one clear line."""
    model, _ = llama2
    hf = transformers.LlamaTokenizer.from_pretrained(str(model.parent))
    args = ModelArgs(vocab_size=len(hf), dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=64)
    with pytest.raises(UserError, match="Metaspace adds none before a leading space.*export it with --format hf"):
        write_gguf(Transformer(args), hf.backend_tokenizer, {}, tmp_path / "metaspace.gguf", "f32")
    assert not list(tmp_path.iterdir())
