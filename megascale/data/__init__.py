"""Training data: corpora, tokenizers, token shards on disk, packing and resumable sampling.

Text goes in once through `prepare_dataset` (cached by source and tokenizer); training reads the
memory-mapped shards through `build_dataloaders`. Sources read through Hugging Face `datasets` may also be
streamed (tokenized while training), and several sources mixed by weight. The format and rules are in
docs/data.md.
"""

from megascale.data.corpus import Corpus, open_corpus
from megascale.data.dataset import DocumentSplit, PackedSequences, split_by_documents
from megascale.data.loader import TrainLoader, build_dataloaders
from megascale.data.mixture import MixtureSampler, MixtureSchedule
from megascale.data.prepare import prepare_dataset, prepare_sources
from megascale.data.sampler import SequenceSampler
from megascale.data.shards import TokenShards
from megascale.data.streaming import StreamingTrainLoader, StreamingValLoader
from megascale.data.tokenizer import ByteTokenizer, JsonTokenizer, Tokenizer, load_tokenizer, train_bpe
from megascale.data.validation import ValLoader

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DocumentSplit",
    "JsonTokenizer",
    "MixtureSampler",
    "MixtureSchedule",
    "PackedSequences",
    "SequenceSampler",
    "StreamingTrainLoader",
    "StreamingValLoader",
    "TokenShards",
    "Tokenizer",
    "TrainLoader",
    "ValLoader",
    "build_dataloaders",
    "load_tokenizer",
    "open_corpus",
    "prepare_dataset",
    "prepare_sources",
    "split_by_documents",
    "train_bpe",
]
