"""Graph networks written the way jraph's users write them, at test size.

Written here, not copied: message passing with `x[senders]` and `jax.ops.segment_sum`, as
jraph's `GraphNetwork` and `GraphConvolution` aggregate, in the model's own code between
layers. Batches hold a star graph (2,000 leaves sending into one hub) beside small chains:
the hub's sum adds 2,000 messages, which 16 bits cannot hold.

- `LinenGraphNet`: jraph's GraphNetwork in Linen: edge update from (edge, sender, receiver),
  node update from the summed incoming edges (LayerNorm after it), a per-graph mean read out.
- `LinenGCN`: jraph's GraphConvolution in Linen: degree-normalised sums of neighbours.
- `NnxGraphNet`: the GraphNetwork in NNX.
- `EqxGCN`: the GraphConvolution in Equinox.

`graph_batches(key, steps)`: a dict of arrays, stacked over steps, `graph_loss(logits, batch)`.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

LEAVES, CHAINS, CHAIN = 2000, 8, 10
N_NODES = 1 + LEAVES + CHAINS * CHAIN
N_GRAPHS = 1 + CHAINS
FEATURES = 4


def _structure():
    hub = [(i, 0) for i in range(1, LEAVES + 1)]
    chains = []
    for c in range(CHAINS):
        start = 1 + LEAVES + c * CHAIN
        for i in range(CHAIN - 1):
            chains += [(start + i, start + i + 1), (start + i + 1, start + i)]
    edges = hub + chains
    senders = jnp.array([s for s, _ in edges], jnp.int32)
    receivers = jnp.array([r for _, r in edges], jnp.int32)
    node_graph = jnp.array([0] * (1 + LEAVES) + [1 + n // CHAIN for n in range(CHAINS * CHAIN)])
    return senders, receivers, node_graph


def graph_batches(key, steps):
    """Node features with a positive mean (the hub's sum grows with its in-degree), edge
    features, and a label per graph: is its mean first feature above its mean second? (Each
    graph's first feature is shifted by its own random amount, so the label is learnable.)"""
    senders, receivers, node_graph = _structure()
    k1, k2, k3 = jax.random.split(key, 3)
    nodes = 1.0 + jax.random.normal(k1, (steps, N_NODES, FEATURES))
    shift = 0.5 * jax.random.normal(k3, (steps, N_GRAPHS))
    nodes = nodes.at[:, :, 0].add(shift[:, node_graph])
    edges = jax.random.normal(k2, (steps, senders.shape[0], 2))
    sums = jax.vmap(lambda n: jax.ops.segment_sum(n, node_graph, N_GRAPHS))(nodes)
    labels = (sums[..., 0] > sums[..., 1]).astype(jnp.int32)
    tile = lambda a: jnp.broadcast_to(a, (steps, *a.shape))  # noqa: E731
    return {
        "nodes": nodes,
        "edges": edges,
        "senders": tile(senders),
        "receivers": tile(receivers),
        "node_graph": tile(node_graph),
        "labels": labels,
    }


def graph_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def _mlp(features):
    return nn.Sequential([nn.Dense(features), nn.relu, nn.Dense(features)])


class LinenGraphNet(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, batch):
        nodes, edges = batch["nodes"], batch["edges"]
        senders, receivers = batch["senders"], batch["receivers"]
        for _ in range(2):
            edges = _mlp(self.hidden)(
                jnp.concatenate([edges, nodes[senders], nodes[receivers]], axis=-1)
            )
            incoming = jax.ops.segment_sum(edges, receivers, N_NODES)
            nodes = nn.LayerNorm()(_mlp(self.hidden)(jnp.concatenate([nodes, incoming], -1)))
        counts = jax.ops.segment_sum(jnp.ones(N_NODES), batch["node_graph"], N_GRAPHS)
        pooled = jax.ops.segment_sum(nodes, batch["node_graph"], N_GRAPHS) / counts[:, None]
        return nn.Dense(2, name="readout")(pooled)


class LinenGCN(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, batch):
        nodes, senders, receivers = batch["nodes"], batch["senders"], batch["receivers"]
        ones = jnp.ones(senders.shape, nodes.dtype)
        degree = jax.ops.segment_sum(ones, receivers, N_NODES) + 1.0  # with a self loop
        for _ in range(2):
            h = nn.Dense(self.hidden)(nodes)
            summed = jax.ops.segment_sum(h[senders], receivers, N_NODES) + h
            nodes = nn.relu(summed / jnp.sqrt(degree)[:, None])
        counts = jax.ops.segment_sum(jnp.ones_like(degree), batch["node_graph"], N_GRAPHS)
        pooled = jax.ops.segment_sum(nodes, batch["node_graph"], N_GRAPHS) / counts[:, None]
        return nn.Dense(2, name="readout")(pooled)


class _NnxMLP(nnx.Module):
    def __init__(self, din, hidden, rngs):
        self.fc1 = nnx.Linear(din, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.relu(self.fc1(x)))


class NnxGraphNet(nnx.Module):
    def __init__(self, rngs, hidden=16):
        self.edge_mlps = nnx.List(
            [_NnxMLP(2 + 2 * FEATURES, hidden, rngs), _NnxMLP(3 * hidden, hidden, rngs)]
        )
        self.node_mlps = nnx.List(
            [_NnxMLP(FEATURES + hidden, hidden, rngs), _NnxMLP(2 * hidden, hidden, rngs)]
        )
        self.norms = nnx.List([nnx.LayerNorm(hidden, rngs=rngs) for _ in range(2)])
        self.readout = nnx.Linear(hidden, 2, rngs=rngs)

    def __call__(self, batch):
        nodes, edges = batch["nodes"], batch["edges"]
        senders, receivers = batch["senders"], batch["receivers"]
        for edge_mlp, node_mlp, norm in zip(
            self.edge_mlps, self.node_mlps, self.norms, strict=True
        ):
            edges = edge_mlp(jnp.concatenate([edges, nodes[senders], nodes[receivers]], -1))
            incoming = jax.ops.segment_sum(edges, receivers, N_NODES)
            nodes = norm(node_mlp(jnp.concatenate([nodes, incoming], axis=-1)))
        counts = jax.ops.segment_sum(jnp.ones(N_NODES), batch["node_graph"], N_GRAPHS)
        pooled = jax.ops.segment_sum(nodes, batch["node_graph"], N_GRAPHS) / counts[:, None]
        return self.readout(pooled)


def make_eqx_gcn(key, hidden=16):
    return _eqx_gcn_class()(key, hidden)


@functools.cache
def _eqx_gcn_class():
    import equinox as eqx  # an extra: only its tests import it

    class EqxGCN(eqx.Module):
        layers: list
        readout: eqx.nn.Linear

        def __init__(self, key, hidden):
            k1, k2, k3 = jax.random.split(key, 3)
            self.layers = [
                eqx.nn.Linear(FEATURES, hidden, key=k1),
                eqx.nn.Linear(hidden, hidden, key=k2),
            ]
            self.readout = eqx.nn.Linear(hidden, 2, key=k3)

        def __call__(self, batch):
            nodes, senders, receivers = batch["nodes"], batch["senders"], batch["receivers"]
            ones = jnp.ones(senders.shape, nodes.dtype)
            degree = jax.ops.segment_sum(ones, receivers, N_NODES) + 1.0
            for layer in self.layers:
                h = jax.vmap(layer)(nodes)
                summed = jax.ops.segment_sum(h[senders], receivers, N_NODES) + h
                nodes = jax.nn.relu(summed / jnp.sqrt(degree)[:, None])
            counts = jax.ops.segment_sum(jnp.ones_like(degree), batch["node_graph"], N_GRAPHS)
            pooled = jax.ops.segment_sum(nodes, batch["node_graph"], N_GRAPHS) / counts[:, None]
            return jax.vmap(self.readout)(pooled)

    return EqxGCN
