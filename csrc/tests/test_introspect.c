/*
 * test_introspect.c -- what the core tells about itself without changing
 * anything: bt_foreach_pending (every timer scheduled and not yet run,
 * cancelled or dropped, with its port, payload, id and deadline) and the
 * lateness sum of bt_get_stats.  The manual clock makes every figure exact;
 * one threaded test walks while other threads schedule, cancel and fire
 * (under TSan, the walk's reads race nothing they must not).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "bucketimer.h"

#include "check.h"

#define MAXSEEN 16

struct seen {
    int n;
    bt_port *port[MAXSEEN];
    void *payload[MAXSEEN];
    uint64_t id[MAXSEEN];
    int64_t deadline[MAXSEEN];
    int stop_after; /* 0: never stop */
};

static int32_t record(void *ctx, bt_port *port, void *payload, uint64_t id, int64_t deadline) {
    struct seen *s = ctx;
    if (s->n < MAXSEEN) {
        s->port[s->n] = port;
        s->payload[s->n] = payload;
        s->id[s->n] = id;
        s->deadline[s->n] = deadline;
    }
    s->n++;
    return s->stop_after && s->n >= s->stop_after;
}

/* the reported timer whose payload is p, or -1 */
static int find(const struct seen *s, void *p) {
    for (int i = 0; i < s->n && i < MAXSEEN; i++)
        if (s->payload[i] == p) return i;
    return -1;
}

static void native_noop(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
}

/* PENDING and POSTED timers are reported, with their port, payload, id and
 * deadline (a postpone's); cancelled, run and taken ones are not. */
static void test_reports_pending_and_posted(void) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p;
    CHECK(bt_port_open(tt, 0, &p) == 0);
    uint64_t due, later, moved, gone, native;
    CHECK(bt_schedule_port(tt, 2000, p, (void *)1, &due) == 0);
    CHECK(bt_schedule_port(tt, 9000, p, (void *)2, &later) == 0);
    CHECK(bt_schedule_port(tt, 5000, p, (void *)3, &moved) == 0);
    CHECK(bt_schedule_port(tt, 5000, p, (void *)4, &gone) == 0);
    CHECK(bt_schedule_native(tt, 7000, native_noop, (void *)5, &native) == 0);
    CHECK(bt_postpone(tt, moved, 8000) == BT_POSTPONED);
    CHECK(bt_cancel(tt, gone) == BT_CANCELLED);
    CHECK(bt_advance(tt, 2500) == 1); /* `due` is posted to p, not yet taken */

    struct seen s = {0};
    CHECK(bt_foreach_pending(tt, record, &s) == 4);
    CHECK(s.n == 4);
    int i = find(&s, (void *)1);
    CHECK(i >= 0 && s.port[i] == p && s.id[i] == due && s.deadline[i] == 2000);
    i = find(&s, (void *)2);
    CHECK(i >= 0 && s.port[i] == p && s.id[i] == later && s.deadline[i] == 9000);
    i = find(&s, (void *)3);
    CHECK(i >= 0 && s.id[i] == moved && s.deadline[i] == 8000);
    i = find(&s, (void *)5);
    CHECK(i >= 0 && s.port[i] == NULL && s.id[i] == native && s.deadline[i] == 7000);
    CHECK(find(&s, (void *)4) < 0);

    /* the walk changed nothing: the posted one is still there to run */
    bt_stats st;
    bt_get_stats(tt, &st);
    CHECK(st.scheduled == 5 && st.cancelled == 1 && st.ran == 0);
    uint64_t ids[4];
    CHECK(bt_port_drain_ids(p, ids, 4) == 1 && ids[0] == due);

    memset(&s, 0, sizeof(s));
    CHECK(bt_foreach_pending(tt, record, &s) == 3);
    CHECK(find(&s, (void *)1) < 0);

    /* fn stops the walk */
    memset(&s, 0, sizeof(s));
    s.stop_after = 2;
    CHECK(bt_foreach_pending(tt, record, &s) == 2 && s.n == 2);

    CHECK(bt_foreach_pending(NULL, record, &s) == -EINVAL);
    CHECK(bt_foreach_pending(tt, NULL, &s) == -EINVAL);
    CHECK(bt_destroy(tt) == 0);
}

/* After bt_stop and bt_drop_all nothing is pending. */
static void test_nothing_after_drop_all(void) {
    bt_timer_thread *tt = manual_core(0);
    uint64_t id;
    CHECK(bt_schedule_native(tt, 100, native_noop, NULL, &id) == 0);
    struct seen s = {0};
    CHECK(bt_foreach_pending(tt, record, &s) == 1);
    CHECK(bt_stop(tt) == 0);
    CHECK(bt_drop_all(tt, NULL, NULL) == 1);
    memset(&s, 0, sizeof(s));
    CHECK(bt_foreach_pending(tt, record, &s) == 0 && s.n == 0);
    CHECK(bt_destroy(tt) == 0);
}

/* lateness_sum: each timer that ran adds how late it ran, in ns, as
 * lateness_hist counts it; a timer due "as soon as possible" adds at most
 * the last bucket's start, so the sum never wraps. */
static void test_lateness_sum(void) {
    bt_timer_thread *tt = manual_core(1000);
    bt_port *p;
    CHECK(bt_port_open(tt, 0, &p) == 0);
    uint64_t id;
    CHECK(bt_schedule_native(tt, 1000, native_noop, NULL, &id) == 0); /* 500 late */
    CHECK(bt_schedule_native(tt, 1200, native_noop, NULL, &id) == 0); /* 300 late */
    CHECK(bt_schedule_port(tt, 1400, p, NULL, &id) == 0);             /* posted at 1500 */
    CHECK(bt_advance(tt, 1500) == 3);
    CHECK(bt_advance(tt, 2400) == 0); /* the port's runs 1000 late, when claimed */
    uint64_t ids[1];
    CHECK(bt_port_drain_ids(p, ids, 1) == 1);
    bt_stats s;
    bt_get_stats(tt, &s);
    CHECK(s.ran == 3);
    CHECK(s.lateness_sum == 500 + 300 + 1000);
    uint64_t counted = 0;
    for (int i = 0; i < BT_HIST_BUCKETS; i++) counted += s.lateness_hist[i];
    CHECK(counted == 3);

    CHECK(bt_schedule_native(tt, bt_deadline_at(-1e300), native_noop, NULL, &id) == 0);
    CHECK(bt_advance(tt, 2500) == 1);
    bt_get_stats(tt, &s);
    CHECK(s.lateness_hist[BT_HIST_BUCKETS - 1] == 1);
    CHECK(s.lateness_sum == 1800 + ((uint64_t)1 << (BT_HIST_BUCKETS - 2)));
    CHECK(bt_destroy(tt) == 0);
}

/* A walk on a running core while other threads schedule, cancel and fire:
 * each timer reported is one timer's (its payload is its deadline); at rest
 * the walk finds exactly the timers the counters call pending. */
#define WORKERS 3
#define ROUNDS 3000
#define HOUR_NS (3600LL * 1000000000LL)

struct race {
    bt_timer_thread *tt;
    bt_port *port;
    _Atomic int finished; /* workers done */
};

static void *churn(void *arg) {
    struct race *r = arg;
    int64_t now = bt_now_ns();
    for (int i = 0; i < ROUNDS; i++) {
        /* every third one due at once, the others in an hour; every other
         * one cancelled (which a fire may win) */
        int64_t deadline = now + (i % 3 == 0 ? 0 : HOUR_NS) + i;
        uint64_t id;
        if (bt_schedule_port(r->tt, deadline, r->port, (void *)(intptr_t)deadline, &id) == 0 &&
            i % 2)
            bt_cancel(r->tt, id);
    }
    atomic_fetch_add(&r->finished, 1);
    return NULL;
}

static int32_t check_consistent(void *ctx, bt_port *port, void *payload, uint64_t id,
                                int64_t deadline) {
    struct race *r = ctx;
    CHECK(port == r->port && id != 0);
    CHECK((intptr_t)payload == deadline);
    return 0;
}

static void test_walk_races_the_core(void) {
    struct race r = {threaded_core(), NULL, 0};
    r.port = open_port(r.tt);
    pthread_t th[WORKERS];
    for (int i = 0; i < WORKERS; i++) CHECK(pthread_create(&th[i], NULL, churn, &r) == 0);
    /* walk all the while the workers run */
    for (int k = 0; k < 20 || atomic_load(&r.finished) < WORKERS; k++)
        CHECK(bt_foreach_pending(r.tt, check_consistent, &r) >= 0);
    for (int i = 0; i < WORKERS; i++) pthread_join(th[i], NULL);
    CHECK(bt_deliver_due(r.tt) == 0);
    uint64_t ids[256];
    while (bt_port_drain_ids(r.port, ids, 256) > 0) {
    }
    bt_stats s;
    bt_get_stats(r.tt, &s);
    struct seen sn = {0};
    int64_t n = bt_foreach_pending(r.tt, record, &sn);
    CHECK(n == (int64_t)(s.scheduled - s.ran - s.cancelled - s.dropped));
    /* the ones due in an hour that were not cancelled: even i, not a multiple of 3 */
    CHECK(n == WORKERS * (ROUNDS / 2 - ROUNDS / 6));
    CHECK(bt_destroy(r.tt) == 0);
}

int main(void) {
    static const struct test tests[] = {
        {"reports_pending_and_posted", test_reports_pending_and_posted},
        {"nothing_after_drop_all", test_nothing_after_drop_all},
        {"lateness_sum", test_lateness_sum},
        {"walk_races_the_core", test_walk_races_the_core},
    };
    return run_tests(tests, sizeof(tests) / sizeof(tests[0]));
}
