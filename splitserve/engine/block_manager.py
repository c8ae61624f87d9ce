"""Fixed-size KV blocks with reference counts and a prefix cache.

A full block is identified by a chained hash of (previous block's hash, its token ids), so
two requests that share a prefix share blocks. The hash is SHA-256 (as in vLLM): with
Python's hash() a client could build colliding prompts offline and have its blocks served
as another tenant's prefix. A block's hash is published only once its KV
has been computed — a request never reuses a block some other request is still filling.
Freed blocks keep their hash and go to the back of the free queue; allocation takes from
the front, so cached blocks are reused in least-recently-freed order.
"""
from __future__ import annotations

import array
import hashlib
from collections import OrderedDict

from splitserve.engine.request import Request


def chain_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """SHA-256 over the parent's digest and the ids as int64s (ids are < 2**63: vocab indices)."""
    digest = hashlib.sha256(parent or b"\0" * 32)
    digest.update(array.array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 block_hash=chain_hash):
        """block_hash(parent, token_ids): chain_hash; the planner's simulator, whose token ids are
        its own, passes a cheaper one (nothing there comes from a client)."""
        self.num_blocks = num_blocks
        self._hash = block_hash
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Free blocks in reuse order (front first); an OrderedDict gives O(1) removal of a
        # cached block that gets revived from the middle.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, request: Request) -> tuple[list[int], list[bytes]]:
        """Blocks (and their hashes) holding a computed prefix of the request's tokens."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return [], []  # prompt logprobs need every prompt position's logits: nothing is skipped
        tokens = request.all_token_ids
        # The last token is always recomputed: its logits are needed to sample.
        max_blocks = (len(tokens) - 1) // self.block_size
        blocks, hashes, parent = [], [], None
        for i in range(max_blocks):
            h = self._hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        cached, _ = self._cached_prefix(request)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        return self.blocks_needed(num_tokens) - len(cached) + revived <= self.num_free_blocks

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Give a request with no blocks enough blocks for num_tokens, reusing cached ones."""
        assert not request.block_table, "request already holds blocks"
        if not self.can_allocate(request, num_tokens):
            raise RuntimeError("allocate() called without can_allocate()")
        cached, hashes = self._cached_prefix(request)
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.free_blocks[b]
            self.ref_counts[b] += 1
        request.block_table = list(cached)
        request.block_hashes = list(hashes)
        request.num_cached_tokens = len(cached) * self.block_size
        request.num_computed_tokens = request.num_cached_tokens
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += request.num_cached_tokens
        self._grow(request, self.blocks_needed(num_tokens) - len(cached))

    def _grow(self, request: Request, count: int) -> None:
        free, block_hash, hash_to_block, table = self.free_blocks, self.block_hash, self.hash_to_block, request.block_table
        for _ in range(count):
            block, _ = free.popitem(last=False)
            old = block_hash[block]
            if old is not None:
                if hash_to_block.get(old) == block:
                    del hash_to_block[old]  # evict: its content is about to be overwritten
                block_hash[block] = None
            self.ref_counts[block] = 1
            table.append(block)

    def can_append(self, request: Request, num_new_tokens: int = 1) -> bool:
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, request: Request, num_new_tokens: int = 1) -> None:
        """Make room for num_new_tokens more tokens after the computed ones."""
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError("append_slots() called without can_append()")
        if need > 0:
            self._grow(request, need)

    def publish_computed(self, request: Request) -> None:
        """Register the hashes of the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        bs, hashes = self.block_size, request.block_hashes
        if request.num_computed_tokens // bs <= len(hashes):
            return  # no block filled since the last call: the common case, once per decoded token
        full = min(request.num_computed_tokens, request.num_tokens) // bs
        if len(hashes) >= full:
            return
        # the prompt alone when the new blocks lie in it (no copy of prompt + output each time)
        tokens = request.prompt_token_ids if full * bs <= request.num_prompt_tokens else request.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), full):
            parent = self._hash(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)
            block = request.block_table[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = parent
                self.hash_to_block.setdefault(parent, block)

    def free(self, request: Request) -> None:
        # Tail blocks first, so a prefix's head blocks stay cached longest.
        for block in reversed(request.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        request.block_table = []
        request.block_hashes = []

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0
