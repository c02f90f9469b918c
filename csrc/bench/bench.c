/*
 * bench.c -- the reference single-lock heap timer and the GIL-free benchmark
 * loops of bucketimer_bench.h.
 *
 * The reference timer is the classic design that brpc's bucketed TimerThread
 * replaced: one mutex around one binary heap.  It is written to be a strong
 * baseline, not a straw man: entries carry their key next to the slot index
 * so sift compares never chase pointers, cancel removes the entry at once
 * (so the heap never holds garbage), slots are recycled through a free list,
 * and the thread is signalled only when a new timer becomes the earliest.
 * What it cannot avoid is that every schedule and every cancel of every
 * thread serialises on the one lock, and that both cost O(log n).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketimer_bench.h"

/* ---- the reference timer ------------------------------------------------ */

enum ref_state { REF_FREE = 0, REF_PENDING = 1, REF_RUNNING = 2 };

#define REF_NOT_IN_HEAP UINT32_MAX
#define REF_NIL UINT32_MAX

/* One timer.  Its index in the table is its id's low half minus one. */
struct ref_slot {
    int64_t deadline;
    uint64_t seq;
    bt_native_fn fn;
    void *arg;
    uint32_t gen;        /* moves on every time the slot is freed */
    uint32_t heap_index; /* where it sits in the heap, or REF_NOT_IN_HEAP */
    uint32_t next_free;  /* free-list link, or REF_NIL */
    uint32_t state;      /* enum ref_state */
};

/* A heap entry: the key copied next to the slot index. */
struct ref_entry {
    int64_t deadline;
    uint64_t seq;
    uint32_t slot;
};

struct bt_ref_timer {
    pthread_mutex_t mutex; /* guards everything below */
    pthread_cond_t cond;   /* the thread waits here (CLOCK_MONOTONIC) */
    struct ref_slot *slots;
    uint32_t nslots, cap_slots;
    uint32_t free_head;
    struct ref_entry *heap;
    uint32_t size, cap;
    uint64_t seq;
    uint64_t fired;
    int sleeping;       /* the thread is (about to be) in cond wait */
    int64_t sleep_until; /* ... until this deadline (INT64_MAX: no timeout) */
    int stop;
    int started;
    pthread_t thread;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int entry_less(const struct ref_entry *a, const struct ref_entry *b) {
    return a->deadline < b->deadline || (a->deadline == b->deadline && a->seq < b->seq);
}

static inline void heap_set(bt_ref_timer *rt, uint32_t i, struct ref_entry e) {
    rt->heap[i] = e;
    rt->slots[e.slot].heap_index = i;
}

static void sift_up(bt_ref_timer *rt, uint32_t i) {
    struct ref_entry e = rt->heap[i];
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!entry_less(&e, &rt->heap[parent])) break;
        heap_set(rt, i, rt->heap[parent]);
        i = parent;
    }
    heap_set(rt, i, e);
}

static void sift_down(bt_ref_timer *rt, uint32_t i) {
    struct ref_entry e = rt->heap[i];
    for (;;) {
        uint32_t child = 2 * i + 1;
        if (child >= rt->size) break;
        if (child + 1 < rt->size && entry_less(&rt->heap[child + 1], &rt->heap[child])) child++;
        if (!entry_less(&rt->heap[child], &e)) break;
        heap_set(rt, i, rt->heap[child]);
        i = child;
    }
    heap_set(rt, i, e);
}

/* Removes heap[i]. */
static void heap_remove(bt_ref_timer *rt, uint32_t i) {
    rt->slots[rt->heap[i].slot].heap_index = REF_NOT_IN_HEAP;
    rt->size--;
    if (i == rt->size) return;
    struct ref_entry last = rt->heap[rt->size];
    heap_set(rt, i, last);
    if (i > 0 && entry_less(&rt->heap[i], &rt->heap[(i - 1) / 2]))
        sift_up(rt, i);
    else
        sift_down(rt, i);
}

/* Under the mutex: a free slot index, growing the table if needed. */
static int slot_alloc(bt_ref_timer *rt, uint32_t *out) {
    if (rt->free_head == REF_NIL) {
        if (rt->nslots == rt->cap_slots) {
            uint32_t cap = rt->cap_slots ? rt->cap_slots * 2 : 1024;
            if (cap <= rt->cap_slots || cap > (UINT32_MAX >> 1)) return -ENOMEM;
            struct ref_slot *s = realloc(rt->slots, (size_t)cap * sizeof(*s));
            if (!s) return -ENOMEM;
            rt->slots = s;
            rt->cap_slots = cap;
        }
        struct ref_slot *s = &rt->slots[rt->nslots];
        memset(s, 0, sizeof(*s));
        s->gen = 1;
        s->heap_index = REF_NOT_IN_HEAP;
        s->next_free = REF_NIL;
        *out = rt->nslots++;
        return 0;
    }
    *out = rt->free_head;
    rt->free_head = rt->slots[*out].next_free;
    return 0;
}

static void slot_free(bt_ref_timer *rt, uint32_t i) {
    struct ref_slot *s = &rt->slots[i];
    s->state = REF_FREE;
    s->gen++;
    if (s->gen == 0) s->gen = 1;
    s->fn = NULL;
    s->arg = NULL;
    s->next_free = rt->free_head;
    rt->free_head = i;
}

static void *ref_thread_main(void *arg) {
    bt_ref_timer *rt = arg;
    pthread_mutex_lock(&rt->mutex);
    while (!rt->stop) {
        if (rt->size == 0) {
            rt->sleeping = 1;
            rt->sleep_until = INT64_MAX;
            pthread_cond_wait(&rt->cond, &rt->mutex);
            rt->sleeping = 0;
            continue;
        }
        int64_t now = now_ns();
        struct ref_entry top = rt->heap[0];
        if (top.deadline > now) {
            struct timespec ts;
            ts.tv_sec = (time_t)(top.deadline / 1000000000);
            ts.tv_nsec = (long)(top.deadline % 1000000000);
            rt->sleeping = 1;
            rt->sleep_until = top.deadline;
            pthread_cond_timedwait(&rt->cond, &rt->mutex, &ts);
            rt->sleeping = 0;
            continue;
        }
        heap_remove(rt, 0);
        struct ref_slot *s = &rt->slots[top.slot];
        s->state = REF_RUNNING;
        bt_native_fn fn = s->fn;
        void *fn_arg = s->arg;
        uint64_t id = ((uint64_t)s->gen << 32) | (top.slot + 1u);
        rt->fired++;
        pthread_mutex_unlock(&rt->mutex);
        fn(fn_arg, id);
        pthread_mutex_lock(&rt->mutex);
        slot_free(rt, top.slot);
    }
    pthread_mutex_unlock(&rt->mutex);
    return NULL;
}

int bt_ref_create(bt_ref_timer **out) {
    if (!out) return -EINVAL;
    *out = NULL;
    bt_ref_timer *rt = calloc(1, sizeof(*rt));
    if (!rt) return -ENOMEM;
    rt->free_head = REF_NIL;
    pthread_mutex_init(&rt->mutex, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&rt->cond, &ca);
    pthread_condattr_destroy(&ca);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&rt->thread, NULL, ref_thread_main, rt);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        pthread_cond_destroy(&rt->cond);
        pthread_mutex_destroy(&rt->mutex);
        free(rt);
        return -rc;
    }
    rt->started = 1;
    *out = rt;
    return 0;
}

int bt_ref_schedule(bt_ref_timer *rt, int64_t deadline_ns, bt_native_fn fn, void *arg,
                    uint64_t *out_id) {
    if (!rt || !fn || !out_id) return -EINVAL;
    pthread_mutex_lock(&rt->mutex);
    if (rt->stop) {
        pthread_mutex_unlock(&rt->mutex);
        return -ESHUTDOWN;
    }
    if (rt->size == rt->cap) {
        uint32_t cap = rt->cap ? rt->cap * 2 : 1024;
        struct ref_entry *h = cap > rt->cap ? realloc(rt->heap, (size_t)cap * sizeof(*h)) : NULL;
        if (!h) {
            pthread_mutex_unlock(&rt->mutex);
            return -ENOMEM;
        }
        rt->heap = h;
        rt->cap = cap;
    }
    uint32_t i;
    int rc = slot_alloc(rt, &i);
    if (rc) {
        pthread_mutex_unlock(&rt->mutex);
        return rc;
    }
    struct ref_slot *s = &rt->slots[i];
    s->deadline = deadline_ns;
    s->seq = rt->seq++;
    s->fn = fn;
    s->arg = arg;
    s->state = REF_PENDING;
    struct ref_entry e = {deadline_ns, s->seq, i};
    rt->heap[rt->size] = e;
    s->heap_index = rt->size;
    rt->size++;
    sift_up(rt, rt->size - 1);
    *out_id = ((uint64_t)s->gen << 32) | (i + 1u);
    /* Signal only when the thread sleeps past the new deadline. */
    int wake = rt->sleeping && deadline_ns < rt->sleep_until;
    if (wake) rt->sleep_until = deadline_ns;
    pthread_mutex_unlock(&rt->mutex);
    if (wake) pthread_cond_signal(&rt->cond);
    return 0;
}

int bt_ref_cancel(bt_ref_timer *rt, uint64_t id) {
    uint32_t low = (uint32_t)id;
    if (!rt || low == 0) return BT_UNKNOWN;
    uint32_t i = low - 1, gen = (uint32_t)(id >> 32);
    int result;
    pthread_mutex_lock(&rt->mutex);
    if (i >= rt->nslots || rt->slots[i].gen != gen || rt->slots[i].state == REF_FREE) {
        result = BT_UNKNOWN;
    } else if (rt->slots[i].state == REF_RUNNING) {
        result = BT_TOO_LATE;
    } else {
        heap_remove(rt, rt->slots[i].heap_index);
        slot_free(rt, i);
        result = BT_CANCELLED;
    }
    pthread_mutex_unlock(&rt->mutex);
    return result;
}

uint64_t bt_ref_pending(bt_ref_timer *rt) {
    if (!rt) return 0;
    pthread_mutex_lock(&rt->mutex);
    uint64_t n = rt->size;
    pthread_mutex_unlock(&rt->mutex);
    return n;
}

uint64_t bt_ref_fired(bt_ref_timer *rt) {
    if (!rt) return 0;
    pthread_mutex_lock(&rt->mutex);
    uint64_t n = rt->fired;
    pthread_mutex_unlock(&rt->mutex);
    return n;
}

void bt_ref_destroy(bt_ref_timer *rt) {
    if (!rt) return;
    pthread_mutex_lock(&rt->mutex);
    rt->stop = 1;
    pthread_mutex_unlock(&rt->mutex);
    pthread_cond_broadcast(&rt->cond);
    if (rt->started) pthread_join(rt->thread, NULL);
    pthread_cond_destroy(&rt->cond);
    pthread_mutex_destroy(&rt->mutex);
    free(rt->heap);
    free(rt->slots);
    free(rt);
}

/* ---- benchmark loops ------------------------------------------------------- */

static void noop(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
}

int64_t bt_bench_pairs(bt_timer_thread *tt, int64_t delay_ns, uint64_t n) {
    if (!tt) return -EINVAL;
    int64_t start = now_ns();
    for (uint64_t k = 0; k < n; k++) {
        uint64_t id;
        int rc = bt_schedule_native(tt, now_ns() + delay_ns, noop, NULL, &id);
        if (rc) return rc;
        if (bt_cancel(tt, id) != BT_CANCELLED) return -EPROTO;
    }
    return now_ns() - start;
}

int64_t bt_ref_bench_pairs(bt_ref_timer *rt, int64_t delay_ns, uint64_t n) {
    if (!rt) return -EINVAL;
    int64_t start = now_ns();
    for (uint64_t k = 0; k < n; k++) {
        uint64_t id;
        int rc = bt_ref_schedule(rt, now_ns() + delay_ns, noop, NULL, &id);
        if (rc) return rc;
        if (bt_ref_cancel(rt, id) != BT_CANCELLED) return -EPROTO;
    }
    return now_ns() - start;
}

/* Arrives at the gate and waits for the others (see the header). */
static void gate_wait(uint32_t *gate, uint32_t nthreads) {
    if (!gate) return;
    __atomic_add_fetch(gate, 1, __ATOMIC_ACQ_REL);
    while (__atomic_load_n(gate, __ATOMIC_ACQUIRE) < nthreads) sched_yield();
}

int64_t bt_bench_pairs_gated(bt_timer_thread *tt, int64_t delay_ns, uint64_t n, uint32_t *gate,
                             uint32_t nthreads, int64_t *start_ns) {
    if (!tt) return -EINVAL;
    gate_wait(gate, nthreads);
    if (start_ns) *start_ns = now_ns();
    return bt_bench_pairs(tt, delay_ns, n);
}

int64_t bt_ref_bench_pairs_gated(bt_ref_timer *rt, int64_t delay_ns, uint64_t n, uint32_t *gate,
                                 uint32_t nthreads, int64_t *start_ns) {
    if (!rt) return -EINVAL;
    gate_wait(gate, nthreads);
    if (start_ns) *start_ns = now_ns();
    return bt_ref_bench_pairs(rt, delay_ns, n);
}

static inline int64_t spread(int64_t base, int64_t lo, int64_t hi, uint64_t k, uint64_t n) {
    return base + lo + (int64_t)((double)(hi - lo) * (double)k / (double)n);
}

int bt_bench_fill(bt_timer_thread *tt, int64_t min_delay_ns, int64_t max_delay_ns, uint64_t n,
                  uint64_t *ids) {
    if (!tt || max_delay_ns < min_delay_ns) return -EINVAL;
    int64_t base = now_ns();
    for (uint64_t k = 0; k < n; k++) {
        uint64_t id;
        int rc = bt_schedule_native(tt, spread(base, min_delay_ns, max_delay_ns, k, n), noop,
                                    NULL, &id);
        if (rc) return rc;
        if (ids) ids[k] = id;
    }
    return 0;
}

int bt_ref_bench_fill(bt_ref_timer *rt, int64_t min_delay_ns, int64_t max_delay_ns, uint64_t n,
                      uint64_t *ids) {
    if (!rt || max_delay_ns < min_delay_ns) return -EINVAL;
    int64_t base = now_ns();
    for (uint64_t k = 0; k < n; k++) {
        uint64_t id;
        int rc = bt_ref_schedule(rt, spread(base, min_delay_ns, max_delay_ns, k, n), noop, NULL,
                                 &id);
        if (rc) return rc;
        if (ids) ids[k] = id;
    }
    return 0;
}

uint64_t bt_bench_cancel_all(bt_timer_thread *tt, const uint64_t *ids, uint64_t n) {
    uint64_t won = 0;
    for (uint64_t k = 0; ids && k < n; k++) won += bt_cancel(tt, ids[k]) == BT_CANCELLED;
    return won;
}

uint64_t bt_ref_bench_cancel_all(bt_ref_timer *rt, const uint64_t *ids, uint64_t n) {
    uint64_t won = 0;
    for (uint64_t k = 0; ids && k < n; k++) won += bt_ref_cancel(rt, ids[k]) == BT_CANCELLED;
    return won;
}
