"""Models written the way Equinox's documentation examples write theirs, at test size.

Written here, not copied: each reproduces what its example does that a mixed-precision
rewrite must meet. The ViT prepends a CLS token and adds a positional table sliced to the
sequence length, runs per example under `jax.vmap` and uses `eqx.nn.Dropout`. BERT sums
token, position and segment embeddings, masks attention, and uses dropout (on the attention
weights too) and GELU. The RNN
steps a `GRUCell` through `lax.scan`. The UNet downsamples with convolutions, upsamples with
`ConvTranspose2d` and concatenates skips. The DCGAN pairs a `ConvTranspose2d` generator with
BatchNorm in an `eqx.nn.State` and a LeakyReLU conv discriminator. Each comes with a
synthetic task of its own kind (`TASKS`): `(make(key), batches(key, steps), loss)`.

(Stateful BatchNorm: `user_models.make_eqx_cnn`.)
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

# --- Vision transformer -------------------------------------------------------------------


class _AttentionBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, dim, hidden, heads, rate, key):
        k1, k2, k3 = jr.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.fc1 = eqx.nn.Linear(dim, hidden, key=k2)
        self.fc2 = eqx.nn.Linear(hidden, dim, key=k3)
        self.dropout = eqx.nn.Dropout(rate)

    def __call__(self, x, train, key):
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y)
        y = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.norm2)(x)))
        y = self.dropout(y, inference=not train, key=key)  # relu(...) / (1 - rate), in effect
        return x + jax.vmap(self.fc2)(y)


class ViT(eqx.Module):
    patch_embedding: eqx.nn.Linear
    positions: jax.Array
    cls_token: jax.Array
    blocks: list
    head: eqx.nn.Sequential
    patch: int

    def __init__(self, key, dim=32, patch=4, max_patches=32, classes=4, layers=1):
        keys = jr.split(key, 5)
        self.patch = patch
        self.patch_embedding = eqx.nn.Linear(patch * patch * 3, dim, key=keys[0])
        self.positions = jr.normal(keys[1], (max_patches + 1, dim))  # longer than needed
        self.cls_token = jr.normal(keys[2], (1, dim))
        self.blocks = [_AttentionBlock(dim, 2 * dim, 4, 0.1, k) for k in jr.split(keys[3], layers)]
        self.head = eqx.nn.Sequential(
            [eqx.nn.LayerNorm(dim), eqx.nn.Linear(dim, classes, key=keys[4])]
        )

    def __call__(self, image, train, key):
        c, h, w = image.shape
        p = self.patch
        patches = image.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4)
        x = jax.vmap(self.patch_embedding)(patches.reshape((h // p) * (w // p), c * p * p))
        x = jnp.concatenate((self.cls_token, x), axis=0)
        x += self.positions[: x.shape[0]]
        for block, k in zip(self.blocks, jr.split(key, len(self.blocks)), strict=True):
            x = block(x, train, k)
        return self.head(x[0])


def image_batches(key, steps, batch=16, size=16, classes=4):
    """Images whose class is the quadrant holding a bright square, with noise."""
    k1, k2 = jr.split(key)
    labels = jr.randint(k1, (steps, batch), 0, classes)
    half = size // 2
    rows, cols = (labels // 2) * half, (labels % 2) * half
    yy, xx = jnp.arange(size)[:, None], jnp.arange(size)[None, :]
    inside = (
        (yy >= rows[..., None, None])
        & (yy < rows[..., None, None] + half)
        & (xx >= cols[..., None, None])
        & (xx < cols[..., None, None] + half)
    )
    images = jr.normal(k2, (steps, batch, 3, size, size)) + inside[:, :, None] * 0.15
    return images, labels


def vit_loss(model, images, labels, key):
    keys = jr.split(key, images.shape[0])
    logits = jax.vmap(model, in_axes=(0, None, 0))(images, True, keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# --- BERT ---------------------------------------------------------------------------------


class _BertLayer(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, dim, heads, key):
        k1, k2, k3 = jr.split(key, 3)
        # Dropout on the attention weights (a softmax's output), as BERT has it.
        self.attention = eqx.nn.MultiheadAttention(heads, dim, dropout_p=0.1, key=k1)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=k2)
        self.down = eqx.nn.Linear(4 * dim, dim, key=k3)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, x, mask, key):
        k1, k2, k3 = jr.split(key, 3)
        attended = self.attention(x, x, x, mask=mask, key=k3, inference=False)
        x = jax.vmap(self.norm1)(x + self.dropout(attended, key=k1))  # post-norm, as BERT
        y = jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))
        return jax.vmap(self.norm2)(x + self.dropout(y, key=k2))


class Bert(eqx.Module):
    tokens: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    segments: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout
    layers: list
    pooler: eqx.nn.Linear
    classifier: eqx.nn.Linear

    def __init__(self, key, vocab=32, dim=32, length=16, layers=1, classes=2):
        keys = jr.split(key, 6)
        self.tokens = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.positions = eqx.nn.Embedding(length, dim, key=keys[1])
        self.segments = eqx.nn.Embedding(2, dim, key=keys[2])
        self.norm = eqx.nn.LayerNorm(dim)
        self.dropout = eqx.nn.Dropout(0.1)
        self.layers = [_BertLayer(dim, 4, k) for k in jr.split(keys[3], layers)]
        self.pooler = eqx.nn.Linear(dim, dim, key=keys[4])
        self.classifier = eqx.nn.Linear(dim, classes, key=keys[5])

    def __call__(self, tokens, segments, key):
        length = tokens.shape[0]
        x = (
            jax.vmap(self.tokens)(tokens)
            + jax.vmap(self.positions)(jnp.arange(length))
            + jax.vmap(self.segments)(segments)
        )
        key, dropout_key = jr.split(key)
        x = self.dropout(jax.vmap(self.norm)(x), key=dropout_key)  # a norm's output, dropped
        mask = (tokens != 0)[None, :] & jnp.ones((length, 1), bool)  # padding never attended
        for layer, k in zip(self.layers, jr.split(key, len(self.layers)), strict=True):
            x = layer(x, mask, k)
        return self.classifier(jnp.tanh(self.pooler(x[0])))


def sentence_batches(key, steps, batch=16, length=16, vocab=32):
    """Token pairs: the class says whether token 3 appears more often in segment A or B."""
    tokens = jr.randint(key, (steps, batch, length), 1, vocab)
    tokens = tokens.at[:, :, 0].set(1)  # a [CLS]
    tokens = tokens.at[:, :, -2:].set(0)  # padding
    segments = (jnp.arange(length) >= length // 2).astype(jnp.int32)
    segments = jnp.broadcast_to(segments, tokens.shape)
    threes = tokens % 4 == 3
    labels = (jnp.sum(threes & (segments == 0), -1) > jnp.sum(threes & (segments == 1), -1)).astype(
        jnp.int32
    )
    return (tokens, segments), labels


def bert_loss(model, inputs, labels, key):
    tokens, segments = inputs
    keys = jr.split(key, tokens.shape[0])
    logits = jax.vmap(model)(tokens, segments, keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# --- RNN ----------------------------------------------------------------------------------


class RNN(eqx.Module):
    cell: eqx.nn.GRUCell
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, key, in_size=2, hidden=16):
        k1, k2 = jr.split(key)
        self.cell = eqx.nn.GRUCell(in_size, hidden, key=k1)
        self.linear = eqx.nn.Linear(hidden, 1, use_bias=False, key=k2)
        self.bias = jnp.zeros(1)

    def __call__(self, inputs):
        hidden = jnp.zeros((self.cell.hidden_size,))

        def step(carry, x):
            return self.cell(x, carry), None

        out, _ = jax.lax.scan(step, hidden, inputs)
        return jax.nn.sigmoid(self.linear(out) + self.bias)


def spiral_batches(key, steps, batch=16, length=16):
    """Noisy circles traced clockwise (class 1) or anticlockwise (class 0)."""
    k1, k2, k3 = jr.split(key, 3)
    t = jnp.linspace(0, 2 * jnp.pi, length)
    phase = jr.uniform(k1, (steps, batch, 1), maxval=2 * jnp.pi)
    labels = jr.bernoulli(k2, 0.5, (steps, batch))
    sign = jnp.where(labels, 1.0, -1.0)[..., None]
    xs = jnp.stack([jnp.cos(t + phase), sign * jnp.sin(t + phase)], -1)
    xs = xs + 0.3 * jr.normal(k3, xs.shape)
    return xs, labels.astype(jnp.float32)


def rnn_loss(model, xs, labels, key):
    del key
    pred = jax.vmap(model)(xs)[:, 0]
    return -jnp.mean(labels * jnp.log(pred + 1e-6) + (1 - labels) * jnp.log(1 - pred + 1e-6))


# --- UNet ---------------------------------------------------------------------------------


class UNet(eqx.Module):
    down1: eqx.nn.Conv2d
    down2: eqx.nn.Conv2d
    middle: eqx.nn.Conv2d
    up: eqx.nn.ConvTranspose2d
    out: eqx.nn.Conv2d
    norm: eqx.nn.GroupNorm

    def __init__(self, key, channels=1, width=16):
        keys = jr.split(key, 5)
        self.down1 = eqx.nn.Conv2d(channels, width, 3, padding=1, key=keys[0])
        self.down2 = eqx.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, key=keys[1])
        self.middle = eqx.nn.Conv2d(2 * width, 2 * width, 3, padding=1, key=keys[2])
        self.norm = eqx.nn.GroupNorm(4, 2 * width)
        self.up = eqx.nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1, key=keys[3])
        self.out = eqx.nn.Conv2d(2 * width, channels, 3, padding=1, key=keys[4])

    def __call__(self, x):
        skip = jax.nn.silu(self.down1(x))
        y = jax.nn.silu(self.down2(skip))
        y = jax.nn.silu(self.norm(self.middle(y)))
        y = jax.nn.silu(self.up(y))
        return self.out(jnp.concatenate([y, skip], axis=0))  # the skip connection


def noisy_image_batches(key, steps, batch=8, size=16):
    """Smooth images and their noisy copies (denoising)."""
    k1, k2 = jr.split(key)
    yy, xx = jnp.meshgrid(jnp.linspace(-1, 1, size), jnp.linspace(-1, 1, size), indexing="ij")
    freq = jr.uniform(k1, (steps, batch, 1, 1, 1), minval=1.0, maxval=3.0)
    clean = jnp.sin(freq * xx) * jnp.cos(freq * yy)
    noisy = clean + 0.3 * jr.normal(k2, clean.shape)
    return noisy, clean


def unet_loss(model, noisy, clean, key):
    del key
    return jnp.mean((jax.vmap(model)(noisy) - clean) ** 2)


# --- DCGAN --------------------------------------------------------------------------------


class Generator(eqx.Module):
    project: eqx.nn.Linear
    up1: eqx.nn.ConvTranspose2d
    norm: eqx.nn.BatchNorm
    up2: eqx.nn.ConvTranspose2d

    def __init__(self, key, latent=8, width=16):
        k1, k2, k3 = jr.split(key, 3)
        self.project = eqx.nn.Linear(latent, width * 4 * 4, key=k1)
        self.up1 = eqx.nn.ConvTranspose2d(width, width, 4, stride=2, padding=1, key=k2)
        self.norm = eqx.nn.BatchNorm(width, axis_name="batch", mode="batch")
        self.up2 = eqx.nn.ConvTranspose2d(width, 1, 4, stride=2, padding=1, key=k3)

    def __call__(self, z, state):
        x = self.project(z).reshape(-1, 4, 4)
        x, state = self.norm(self.up1(x), state)
        return jnp.tanh(self.up2(jax.nn.relu(x))), state


class Discriminator(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key, width=16):
        k1, k2, k3 = jr.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, width, 4, stride=2, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(width, width, 4, stride=2, padding=1, key=k2)
        self.head = eqx.nn.Linear(width * 4 * 4, 1, key=k3)

    def __call__(self, x):
        x = jax.nn.leaky_relu(self.conv1(x), 0.2)
        x = jax.nn.leaky_relu(self.conv2(x), 0.2)
        return self.head(x.reshape(-1))[0]


class GAN(eqx.Module):
    generator: Generator
    discriminator: Discriminator

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.generator = Generator(k1)
        self.discriminator = Discriminator(k2)


def make_gan(key):
    return eqx.nn.make_with_state(GAN)(key)


def real_image_batches(key, steps, batch=8, size=16):
    """'Real' images: blobs at random places."""
    k1, k2 = jr.split(key)
    centre = jr.uniform(k1, (steps, batch, 2, 1, 1), minval=-0.5, maxval=0.5)
    yy, xx = jnp.meshgrid(jnp.linspace(-1, 1, size), jnp.linspace(-1, 1, size), indexing="ij")
    blob = jnp.exp(-((xx - centre[:, :, 0]) ** 2 + (yy - centre[:, :, 1]) ** 2) / 0.1)
    return (2 * blob - 1)[:, :, None], jr.normal(k2, (steps, batch, 8))


def gan_loss(model, state, real, z):
    """One loss for both players, as a single optimizer sees them: the discriminator's
    (the generator's samples held fixed) and the generator's non-saturating loss (the
    discriminator held fixed). Returns `(loss, new_state)`."""
    generate = jax.vmap(model.generator, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    fake, state = generate(z, state)
    discriminate = jax.vmap(model.discriminator)
    frozen = jax.lax.stop_gradient(model.discriminator)
    held = jax.lax.stop_gradient(fake)
    d_loss = jnp.mean(jax.nn.softplus(-discriminate(real)) + jax.nn.softplus(discriminate(held)))
    g_loss = jnp.mean(jax.nn.softplus(-jax.vmap(frozen)(fake)))
    return d_loss + g_loss, state


TASKS: dict[str, tuple[Callable, Callable, Callable]] = {
    "vit": (ViT, image_batches, vit_loss),
    "bert": (Bert, sentence_batches, bert_loss),
    "rnn": (RNN, spiral_batches, rnn_loss),
    "unet": (UNet, noisy_image_batches, unet_loss),
}
"""Stateless models: `(make(key), batches(key, steps) -> (inputs, targets), loss(model,
inputs, targets, key))`. The DCGAN (state, two players) is driven on its own."""
