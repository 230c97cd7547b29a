"""A `tf.data` pipeline as a graph: read its ops, evaluate a part of it, replay its tail.

A finite pipeline over files (`TFRecordDataset(files).map(parse).batch(n)`)
is its reader followed by a tail of per-record and per-batch steps. The
ledger's file source (`kfit_ps.ledger.files`) keeps the tail as the user wrote
it and replaces the reader, batch by batch, with one that starts at the
batch's first record (`replay`). A dataset made before the strategy connected
to the cluster is rebuilt from its graph (`on_this_context`). Private: the
dataset's `_as_serialized_graph` and `_variant_tensor` (its device), and the
eager context's `add_function_def` (the graph's functions registered under
names of their own, so that they outlive the user's dataset and reach the
workers); the rest is public (`tf.graph_util.import_graph_def`,
`tf.data.experimental.from_variant`, `tf.raw_ops.DatasetFromGraph`).
"""

import itertools
import weakref

import tensorflow as tf
from tensorflow.python.eager import context

from kfit_ps._tf_compat.versions import check_versions


class Unserializable(ValueError):
    """The pipeline uses state of this process; `reason` is TensorFlow's first line."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def pipeline_graph(dataset, rename=False):
    """`(graph_def, output)`: `dataset`'s GraphDef without its return node, and the name of
    the node that makes the dataset (its functions renamed with `rename`: see
    `_rename_functions`). Raises `Unserializable` when the pipeline uses a variable, a
    lookup table or a Python function of this process."""
    check_versions()
    try:
        serialized = dataset._as_serialized_graph(  # noqa: SLF001
            external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL)
    except (tf.errors.FailedPreconditionError, tf.errors.InvalidArgumentError) as e:
        raise Unserializable(str(e).strip().splitlines()[0][:300]) from None
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized.numpy())
    if rename:
        _rename_functions(graph)
    for function in graph.library.function:  # Outlive the dataset's own.
        context.context().add_function_def(function)
    (retval,) = [node for node in graph.node if node.op == "_Retval"]
    output = retval.input[0].split(":")[0]
    nodes = [node for node in graph.node if node.op != "_Retval"]
    del graph.node[:]
    graph.node.extend(nodes)
    return graph, output


def _rename_functions(graph):
    """Gives `graph`'s functions names of their own (`kfit_ps_<n>_<name>`), in place.

    For a dataset made before the strategy connected to the cluster: registering
    a function under a name the context already knows only counts it again, and
    that dataset's functions were known locally before there were workers to send
    them to; a traced function that reaches them through a file source's
    replayed tail failed on a worker with "Could not find required function
    definition". Fresh names are registered, and sent, anew.
    """
    number = next(_renamed_graphs)
    names = {f.signature.name: f"kfit_ps_{number}_{f.signature.name}"
             for f in graph.library.function}

    def rename(attrs):
        for attr in attrs.values():
            if attr.HasField("func") and attr.func.name in names:
                attr.func.name = names[attr.func.name]
            for func in attr.list.func:
                if func.name in names:
                    func.name = names[func.name]

    for node in graph.node:
        rename(node.attr)
    for function in graph.library.function:
        function.signature.name = names[function.signature.name]
        for node in function.node_def:
            rename(node.attr)
    for gradient in graph.library.gradient:
        if gradient.function_name in names:
            gradient.function_name = names[gradient.function_name]


_renamed_graphs = itertools.count(1)


def constant(graph, name):
    """The numpy value of the Const node `name` (an input name, `node:0` or `node`)."""
    node = next(n for n in graph.node if n.name == name.split(":")[0])
    if node.op != "Const":
        raise ValueError(f"{node.name} is a {node.op}, not a constant")
    return tf.make_ndarray(node.attr["value"].tensor)


def evaluate(graph, output, element_spec):
    """The dataset made by node `output` of `graph`, built here (eagerly)."""
    check_versions()
    with_retval = tf.compat.v1.GraphDef()
    with_retval.CopyFrom(graph)
    retval = with_retval.node.add(name="kfit_ps_output", op="_Retval", input=[output])
    retval.attr["T"].type = tf.variant.as_datatype_enum
    retval.attr["index"].i = 0
    variant = tf.raw_ops.DatasetFromGraph(graph_def=with_retval.SerializeToString())
    return tf.data.experimental.from_variant(variant, element_spec)


def on_this_context(dataset):
    """`dataset`, or, when it was made before the strategy connected to the cluster, the
    same pipeline rebuilt from its graph on the chief's device.

    A dataset made before `connect_to_cluster` lives on `/job:localhost`, a
    device the connected context no longer has: an iterator or an op placed
    beside it (`with_options`) fails with "unknown device". Raises
    `Unserializable` when the pipeline uses state made on that device (a lookup
    table, a variable, a Python generator), which cannot be moved.
    """
    device = dataset._variant_tensor.device  # noqa: SLF001
    known = {tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices()}
    if not device or tf.DeviceSpec.from_string(device) in known:
        return dataset
    rebuilt = _rebuilt.get(dataset)  # One copy per dataset, whatever the number of fits.
    if rebuilt is None:
        graph, output = pipeline_graph(dataset, rename=True)
        rebuilt = _rebuilt[dataset] = evaluate(graph, output, dataset.element_spec)
    return rebuilt


_rebuilt = weakref.WeakKeyDictionary()  # dataset made before the cluster -> its copy here


def replay(graph, output, root, records, element_spec):
    """`graph`'s dataset `output` with the dataset of node `root` replaced by `records`,
    inside a traced function (each call imports the tail once more).

    tf.data's default rewrites are off for the result: with them, a reader
    given byte offsets (`TFRecordDatasetV2`'s fourth input) fails to build
    ("3 inputs specified of 4"), and nothing the tail does needs them.
    """
    check_versions()
    (variant,) = tf.graph_util.import_graph_def(
        graph, input_map={f"{root}:0": tf.data.experimental.to_variant(records)},
        return_elements=[f"{output}:0"], name="kfit_ps_tail")
    dataset = tf.data.experimental.from_variant(variant, element_spec)
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    return dataset.with_options(options)
