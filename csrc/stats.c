/*
 * stats.c -- bt_get_stats: the counters, summed on read (docs/design.rst,
 * rule 10).  Each counter has one writer, or is a relaxed atomic; the sums
 * are exact when the core is quiescent.
 */
#include <string.h>

#include "internal.h"

/* ---- counters (rule 10) ------------------------------------------------- */

/* What a port's consumer counted. */
static void add_port(bt_stats *s, bt_port *p) {
    s->ran += BT_LOAD(p->ran);
    s->dropped += BT_LOAD(p->dropped);
    s->early_fires += BT_LOAD(p->early);
    s->lateness_sum += BT_LOAD(p->late_sum);
    for (int i = 0; i < BT_HIST_BUCKETS; i++) s->lateness_hist[i] += BT_LOAD(p->hist[i]);
}

void bt_get_stats(bt_timer_thread *tt, bt_stats *s) {
    memset(s, 0, sizeof(*s));
    if (!tt || bt__forked(tt)) return;
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        struct bt__bucket *bk = &tt->buckets[b];
        pthread_mutex_lock(&bk->mutex);
        s->scheduled += bk->scheduled;
        s->list_size += bk->length;
        s->slots_free += bk->nfree;
        s->reaped += bk->reaped;
        s->postponed += bk->postponed;
        pthread_mutex_unlock(&bk->mutex);
        s->cancelled += atomic_load_explicit(&bk->cancelled, memory_order_relaxed);
        s->wakeups += atomic_load_explicit(&bk->wakeups, memory_order_relaxed);
    }
#define LD(x) atomic_load_explicit(&tt->x, memory_order_relaxed)
    s->fired = LD(fired);
    s->posted = LD(posted);
    s->passes = LD(passes);
    s->drains = LD(drains);
    s->sweeps = LD(sweeps);
    s->reaped += LD(reaped) + LD(consumer_reaped);
    s->heap_size = LD(heap_size);
    s->eventfd_writes = LD(eventfd_writes);
    s->slots_retired = LD(slots_retired);
    s->dead = s->cancelled > s->reaped ? s->cancelled - s->reaped : 0;
    s->slots = (uint64_t)atomic_load(&tt->nblocks) * BT_BLOCK_SLOTS;
    s->buckets = tt->nbuckets;
    /* Under ports_mutex, where a freed port's counts move into these: a
     * port is summed below or in them, once. */
    pthread_mutex_lock(&tt->ports_mutex);
    s->ran = LD(ran_native);
    s->early_fires = LD(early_native);
    s->lateness_sum = LD(late_sum_native);
    for (int i = 0; i < BT_HIST_BUCKETS; i++) s->lateness_hist[i] = LD(hist_native[i]);
#undef LD
    s->ports = tt->nports;
    s->dropped = tt->gone_dropped;
    for (bt_port *p = tt->ports; p; p = p->all_next) add_port(s, p);
    for (bt_port *p = tt->retired; p; p = p->all_next) add_port(s, p);
    pthread_mutex_unlock(&tt->ports_mutex);
}
