/*
 * oneslot.h -- what the harnesses that schedule share (reuse.c, publish.c,
 * stop.c): the core's real bucket.c, pool.c and port.c, one core with one
 * bucket and one port, and a slot directory of one block of one slot,
 * `slot`, which a schedule takes.
 *
 * CBMC refuses a program that stores a pointer to memory threads share
 * ("pointer handling for concurrency is unsound"); the bucket's free list
 * and its list of timers are such pointers, touched only under the bucket
 * mutex, so in the model copy the schedule takes `slot` directly and does
 * not link it on the list (the pass, which reads that list, is no part of
 * these checks), and bt__pool_cancel's walk of the slot directory looks at
 * that one slot.
 *
 * (tools/model_check.py reads these lines in every harness that includes
 * this file.)
 * adapt bucket.c: struct bt_timer *t = bk->free;\n    bk->free = t->next;\n    bk->nfree--; => struct bt_timer *t = &slot;
 * adapt bucket.c: t->next = bk->head;\n    bk->head = t;\n    return => return
 * adapt bucket.c: if (bk->free) return 0; => return 0;
 * adapt pool.c: for (uint32_t i = 0; i < BT_BLOCK_SLOTS; i++) {\n            struct bt_timer *t = &block[i];\n            uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);\n            for (;;) { => for (uint32_t i = 0; i < 1; i++) {\n            struct bt_timer *t = &block[i];\n            uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);\n            for (;;) {
 */
#ifndef BT_MODEL_ONESLOT_H
#define BT_MODEL_ONESLOT_H

#include "model.h"

static struct bt_timer slot;

#include "../bucket.c"
#include "../pool.c"
#include "../port.c"

#define TAG 1u
#define GEN 7u

static bt_timer_thread core;
static struct bt__bucket buckets[1];
static bt_port port;

/* The id of the slot's generation gen. */
static inline uint64_t id_of(uint32_t gen) {
    return (uint64_t)gen << 32 | TAG << BT_INDEX_BITS;
}

/* The core, its bucket and port, and the slot with its state word. */
static inline void oneslot_init(uint64_t word) {
    core.tag = TAG;
    core.nbuckets = 1;
    core.buckets = buckets;
    core.opt.drain_threshold = 1000;
    core.nearest = BT_NEVER;
    buckets[0].nearest = BT_NEVER;
    buckets[0].prune_at = 1000;
    core.blocks[0] = &slot;
    core.nblocks = 1;
    port.tt = &core;
    slot.slot = TAG << BT_INDEX_BITS;
    slot.word = word;
}

#endif
