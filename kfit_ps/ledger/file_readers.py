"""Which reader a file pipeline's per-file function is: read from the pipeline's graph.

`files.FileSource` reads a pipeline's batches from its files when the
dataset under its per-record and per-batch steps maps each file name of a
list to its records: `TFRecordDataset` or `TextLineDataset` of the name (or
`flat_map`/`interleave` of such a function), possibly after a per-file
`skip(n)`, with a constant `compression_type` (a value the function captures
from its caller counts when the caller's is a constant). `per_file_reader`
says which reader, its compression and the records it skips; `NotFiles` is
the refusal, with its reason.
"""

import tensorflow as tf

from kfit_ps.ledger import whole_files
from kfit_ps.ledger.file_index import TEXT, TFRECORD

_READERS = {"TFRecordDataset": TFRECORD, "TFRecordDatasetV2": TFRECORD, "TextLineDataset": TEXT}
PER_FILE = {"FlatMapDataset", "InterleaveDataset", "ParallelInterleaveDataset",
             "ParallelInterleaveDatasetV2", "ParallelInterleaveDatasetV3",
             "ParallelInterleaveDatasetV4", "LegacyParallelInterleaveDatasetV2"}


class NotFiles(ValueError):
    """The pipeline is not one that a file source can read by batch; `reason` says why."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def node_name(input_name):
    """The name of the node behind a graph input name (`node:1`, `^node`)."""
    return input_name.split(":")[0].lstrip("^")


def _constant(nodes, input_name):
    """The value of the pipeline graph's node behind `input_name` when a Const, else None."""
    node = nodes.get(node_name(input_name))
    return tf.make_ndarray(node.attr["value"].tensor) if node is not None and \
        node.op == "Const" else None


class _Function:
    """A function of the pipeline's graph library, its nodes by name."""

    def __init__(self, function, captured=()):
        self.nodes = {node.name: node for node in function.node_def}
        self.args = [arg.name for arg in function.signature.input_arg]
        self.output = node_name(function.ret[function.signature.output_arg[0].name])
        # The values of the arguments after the first (captured by the caller), None unknown.
        self.captured = dict(zip(self.args[1:], captured))
        self._function = function

    def called_with(self, captured):
        """This function called with the values `captured` (None: unknown) after its first."""
        return _Function(self._function, captured)

    def known(self):
        """Whether every argument after the first has a known (constant) value."""
        return all(self.captured.get(arg) is not None for arg in self.args[1:])

    def source(self, input_name):
        """The node behind `input_name`, through `Identity` and `Reshape` (or the arg name)."""
        name = node_name(input_name)
        while name in self.nodes and self.nodes[name].op in ("Identity", "Reshape"):
            name = node_name(self.nodes[name].input[0])
        return self.nodes.get(name, name)

    def constant(self, input_name):
        node = self.source(input_name)
        if isinstance(node, str):  # An argument: a constant when the caller's is.
            return self.captured.get(node)
        if getattr(node, "op", None) != "Const":
            return None
        return tf.make_ndarray(node.attr["value"].tensor)


def _captured(values, node):
    """The values (`values(input_name)`, None: unknown) of the per-file dataset `node`'s
    captured inputs, in order: what its function's arguments after the file name hold."""
    count = len(node.attr["Targuments"].list.type)
    return [values(name) for name in node.input[1:1 + count]]


def _reader_of(library, name, captured=()):
    """`(kind, compression, skip)` when the library function `name`, called with the values
    `captured` after the file name, maps one file name to its records (a reader of its
    argument, possibly after a per-file `skip`), else None. Raises `NotFiles` for a reader
    whose `compression_type` is not a constant."""
    if name not in library:
        return None
    function = library[name].called_with(captured)
    if not function.args:
        return None
    node, skip = function.source(function.output), 0
    if getattr(node, "op", None) == "SkipDataset":
        count = function.constant(node.input[1])
        if count is None or int(count) < 0:
            return None
        node, skip = function.source(node.input[0]), int(count)
    op, found = getattr(node, "op", None), None
    if op in _READERS:
        if function.source(node.input[0]) != function.args[0]:
            return None
        compression = function.constant(node.input[1])
        if compression is None:  # (A value captured from the caller has no op here.)
            raise NotFiles(whole_files.computed_per_file(
                op, getattr(function.source(node.input[1]), "op", None)))
        found = _READERS[op], compression.item().decode(), skip
    elif op == "FlatMapDataset":  # The per-file reader of `TFRecordDataset(name)`.
        files = function.source(node.input[0])
        if getattr(files, "op", None) != "TensorSliceDataset" or \
                function.source(files.input[0]) != function.args[0]:
            return None
        inner = _reader_of(library, node.attr["f"].func.name,
                           _captured(function.constant, node))
        if inner is None:
            return None
        found = inner[0], inner[1], inner[2] + skip
    # A function of more than the file name (and constants) may read other files or records.
    return found if function.known() else None


def ops_below(nodes, name):
    """The ops of node `name` and of every node it reads from."""
    ops, stack, seen = set(), [name], set()
    while stack:
        node = nodes[stack.pop()]
        if node.name in seen:
            continue
        seen.add(node.name)
        ops.add(node.op)
        stack.extend(node_name(i) for i in node.input if node_name(i) in nodes)
    return ops


def per_file_reader(graph, nodes, node):
    """`(kind, compression, skip)` of the per-file function of the pipeline graph's node
    `node` (`nodes`: the graph's nodes by name), or None when it is not one file's reader."""
    if node.op not in PER_FILE:
        return None
    library = {f.signature.name: _Function(f) for f in graph.library.function}
    return _reader_of(library, node.attr["f"].func.name,
                      _captured(lambda name: _constant(nodes, name), node))
