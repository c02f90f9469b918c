/*
 * heap.c -- the timer thread's private 4-ary min-heap, ordered by
 * (deadline, seq) so equal deadlines fire in schedule order (docs/design.rst
 * rule 7).  Only the timer thread (or the advancing thread in manual-clock
 * mode) touches it, so it has no lock.  A 4-ary heap halves the depth of a
 * binary one and keeps the four children of a node in one cache line pair,
 * as Go 1.14's per-P timer heaps do.
 */
#include <errno.h>
#include <stdlib.h>

#include "internal.h"

/* Entries: the first allocation's capacity, and the least a shrink keeps. */
#define HEAP_MIN_CAP 1024
/* Entries: a heap's capacity must be above this for a shrink to give any back. */
#define HEAP_SHRINK_ABOVE 4096

static inline int less(const struct bt__heap_entry *a, const struct bt__heap_entry *b) {
    return a->deadline < b->deadline || (a->deadline == b->deadline && a->seq < b->seq);
}

static void sift_up(struct bt__heap *h, size_t i) {
    struct bt__heap_entry e = h->v[i];
    while (i > 0) {
        size_t parent = (i - 1) / 4;
        if (!less(&e, &h->v[parent])) break;
        h->v[i] = h->v[parent];
        i = parent;
    }
    h->v[i] = e;
}

static void sift_down(struct bt__heap *h, size_t i) {
    struct bt__heap_entry e = h->v[i];
    size_t n = h->size;
    for (;;) {
        size_t first = 4 * i + 1;
        if (first >= n) break;
        size_t best = first;
        size_t end = first + 4 < n ? first + 4 : n;
        for (size_t c = first + 1; c < end; c++)
            if (less(&h->v[c], &h->v[best])) best = c;
        if (!less(&h->v[best], &e)) break;
        h->v[i] = h->v[best];
        i = best;
    }
    h->v[i] = e;
}

int bt__heap_reserve(struct bt__heap *h, size_t n) {
    if (h->size + n <= h->cap) return 0;
    size_t cap = h->cap ? h->cap : HEAP_MIN_CAP;
    while (cap < h->size + n) cap *= 2;
    struct bt__heap_entry *v = realloc(h->v, cap * sizeof(*v));
    if (!v) return -ENOMEM;
    h->v = v;
    h->cap = cap;
    return 0;
}

int bt__heap_push(struct bt__heap *h, struct bt_timer *t) {
    if (bt__heap_reserve(h, 1)) return -ENOMEM;
    h->v[h->size].deadline = BT_LOAD(t->deadline);
    h->v[h->size].seq = t->seq;
    h->v[h->size].timer = t;
    sift_up(h, h->size++);
    return 0;
}

struct bt_timer *bt__heap_pop(struct bt__heap *h) {
    if (!h->size) return NULL;
    struct bt_timer *t = h->v[0].timer;
    if (--h->size) {
        h->v[0] = h->v[h->size];
        sift_down(h, 0);
    }
    return t;
}

size_t bt__heap_sweep(struct bt__heap *h, int (*dead)(struct bt_timer *),
                      void (*drop)(struct bt_timer *, void *), void *ctx) {
    size_t kept = 0, removed = 0;
    for (size_t i = 0; i < h->size; i++) {
        if (dead(h->v[i].timer)) {
            drop(h->v[i].timer, ctx);
            removed++;
        } else {
            h->v[kept++] = h->v[i];
        }
    }
    h->size = kept;
    /* Floyd's bottom-up heapify: O(n). */
    if (kept > 1)
        for (size_t i = (kept - 2) / 4 + 1; i-- > 0;) sift_down(h, i);
    return removed;
}

void bt__heap_shrink(struct bt__heap *h) {
    /* Give memory back when the heap shrank a lot. */
    if (h->cap > HEAP_SHRINK_ABOVE && h->size < h->cap / 4) {
        size_t cap = h->size * 2 > HEAP_MIN_CAP ? h->size * 2 : HEAP_MIN_CAP;
        struct bt__heap_entry *v = realloc(h->v, cap * sizeof(*v));
        if (v) {
            h->v = v;
            h->cap = cap;
        }
    }
}

/* Removes the entry at position i, keeping heap order. */
static void remove_at(struct bt__heap *h, size_t i) {
    if (i >= h->size) return;
    if (i == --h->size) return;
    h->v[i] = h->v[h->size];
    if (i > 0 && less(&h->v[i], &h->v[(i - 1) / 4])) sift_up(h, i);
    else sift_down(h, i);
}

int bt__heap_sweep_step(struct bt__heap *h, int (*dead)(struct bt_timer *),
                        void (*drop)(struct bt_timer *, void *), void *ctx, size_t *cursor,
                        size_t budget, size_t *removed) {
    size_t i = *cursor;
    while (budget-- > 0 && i < h->size) {
        if (dead(h->v[i].timer)) {
            drop(h->v[i].timer, ctx);
            remove_at(h, i); /* position i now holds an unexamined entry */
            (*removed)++;
        } else {
            i++;
        }
    }
    *cursor = i;
    return i >= h->size;
}

void bt__heap_free(struct bt__heap *h) {
    free(h->v);
    h->v = NULL;
    h->size = h->cap = 0;
}
