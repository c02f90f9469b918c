/*
 * test_reentry.c -- calling the core from inside its own callbacks
 * (docs/guarantees.rst, "Calling the core from its own callbacks"), and the
 * edges of its lifecycle and clock arithmetic: a native callback that stops
 * or destroys a core whose pass is further down its thread's stack, that
 * advances or asks the next deadline of its own manual-clock core, a stop
 * racing an advance, and deadlines computed at the ends of the int64 range.
 * Run by ctest, under TSan and under ASan+UBSan.
 *
 * Built with -Wl,--wrap=pthread_mutex_lock (CMakeLists.txt): a thread can
 * announce that it reached a given mutex, which makes "a bt_advance waits
 * for the one in progress" deterministic.  A test that hangs is ended by
 * SIGALRM (watchdog below), which prints its name and fails the program.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketimer.h"
#include "internal.h" /* white-box: a core's advance mutex */

#include "check.h"

#define MS 1000000LL

/* ---- the watchdog ---------------------------------------------------------- */

static const char *volatile watched_test = "";

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "HUNG (watchdog after 20 s): ";
    (void)!write(2, msg, sizeof(msg) - 1);
    (void)!write(2, watched_test, strlen(watched_test));
    (void)!write(2, "\n", 1);
    _exit(2);
}

/* Arms the watchdog for the test that calls it. */
static void watchdog(const char *name) {
    watched_test = name;
    signal(SIGALRM, on_alarm);
    alarm(20);
}

/* ---- the lock hook --------------------------------------------------------- */

int __real_pthread_mutex_lock(pthread_mutex_t *m);

static _Thread_local int announce_locks; /* set by the thread under watch */
static pthread_mutex_t *_Atomic announced_mutex;
static _Atomic int reached_mutex;

/* A thread with announce_locks set that is about to lock announced_mutex
 * says so first. */
int __wrap_pthread_mutex_lock(pthread_mutex_t *m) {
    if (announce_locks && m == atomic_load(&announced_mutex)) atomic_store(&reached_mutex, 1);
    return __real_pthread_mutex_lock(m);
}

/* ---- helpers --------------------------------------------------------------- */

static void count(void *arg, uint64_t id) {
    (void)id;
    atomic_fetch_add((_Atomic int *)arg, 1);
}

/* Polls *flag for up to `ms` milliseconds; its last value. */
static int wait_flag(_Atomic int *flag, int ms) {
    for (int i = 0; i < ms && !atomic_load(flag); i++) usleep(1000);
    return atomic_load(flag);
}

/* ---- nested cores: a stop or destroy of a core further down the stack ---- */

/* Threaded core A's callback advances manual core M; M's callback stops A.
 * The thread running both is A's own: the stop must not try to join it,
 * and a bt_destroy(A) from another thread must wait for A's callback to
 * return, not free A under it.  (An earlier core knew only the innermost
 * core of a thread's passes: it joined A's thread from A's thread, ignored
 * EDEADLK, marked A joined, and the bt_destroy freed A while A's callback
 * still ran: a segfault.) */
static struct {
    bt_timer_thread *a, *m;
    _Atomic int stop_rc, advanced, destroy_returned, returned_under_callback, callback_returning;
} nest;

static void m_stops_a(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    atomic_store(&nest.stop_rc, bt_stop(nest.a));
}

static void a_advances_m(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    bt_advance(nest.m, 2000);
    atomic_store(&nest.advanced, 1);
    /* A bt_destroy(A) from another thread must not return before this
     * callback does: give it the time to. */
    int early = wait_flag(&nest.destroy_returned, 200);
    if (early) printf("  bt_destroy(A) returned while A's callback still runs\n");
    atomic_store(&nest.returned_under_callback, early);
    atomic_store(&nest.callback_returning, 1);
}

static void *destroy_a(void *arg) {
    (void)arg;
    bt_destroy(nest.a);
    atomic_store(&nest.destroy_returned, 1);
    return NULL;
}

static void test_stop_of_an_outer_threaded_core_from_a_nested_callback(void) {
    watchdog(__func__);
    memset(&nest, 0, sizeof(nest));
    atomic_store(&nest.stop_rc, -1);
    CHECK(bt_create(NULL, &nest.a) == 0);
    nest.m = manual_core(1000);
    uint64_t id;
    CHECK(bt_schedule_native(nest.m, 2000, m_stops_a, NULL, &id) == 0);
    CHECK(bt_schedule_native(nest.a, bt_now_ns(), a_advances_m, NULL, &id) == 0);
    CHECK(wait_flag(&nest.advanced, 5000));
    pthread_t d;
    CHECK(pthread_create(&d, NULL, destroy_a, NULL) == 0);
    pthread_join(d, NULL);
    CHECK(wait_flag(&nest.callback_returning, 5000));
    printf("  bt_stop(A) from M's callback inside A's: rc %d; bt_destroy(A) from another "
           "thread returned %s A's callback did\n",
           atomic_load(&nest.stop_rc),
           atomic_load(&nest.returned_under_callback) ? "BEFORE" : "after");
    CHECK(atomic_load(&nest.stop_rc) == 0);
    CHECK(atomic_load(&nest.returned_under_callback) == 0);
    bt_destroy(nest.m);
}

/* Manual core A's callback advances manual core M; M's callback destroys A,
 * whose bt_advance is further down the stack: A is freed when that
 * bt_advance returns, not under it.  (An earlier core freed it there and
 * then: the rest of A's pass ran in unmapped memory.) */
static struct {
    bt_timer_thread *a, *m;
    _Atomic int64_t advance_rc;
    _Atomic int destroyed, after;
} inner;

static void m_destroys_a(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    bt_destroy(inner.a);
    atomic_store(&inner.destroyed, 1);
}

static void a_advances_m_then_returns(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    atomic_store(&inner.advance_rc, bt_advance(inner.m, 2000));
}

static void test_destroy_of_an_outer_manual_core_from_a_nested_callback(void) {
    watchdog(__func__);
    memset(&inner, 0, sizeof(inner));
    inner.a = manual_core(1000);
    inner.m = manual_core(1000);
    uint64_t id;
    CHECK(bt_schedule_native(inner.m, 2000, m_destroys_a, NULL, &id) == 0);
    CHECK(bt_schedule_native(inner.a, 2000, a_advances_m_then_returns, NULL, &id) == 0);
    CHECK(bt_schedule_native(inner.a, 2000, count, &inner.after, &id) == 0); /* same instant */
    CHECK(bt_advance(inner.a, 2000) == 1); /* frees A as it returns */
    printf("  bt_destroy(A) from M's callback inside A's bt_advance: M's advance fired %lld, "
           "%d of A's timers ran after\n",
           (long long)atomic_load(&inner.advance_rc), atomic_load(&inner.after));
    CHECK(atomic_load(&inner.destroyed) == 1);
    CHECK(atomic_load(&inner.advance_rc) == 1);
    CHECK(atomic_load(&inner.after) == 0);
    bt_destroy(inner.m);
}

/* ---- manual clock: a stop racing an advance --------------------------------- */

/* Thread Y calls bt_advance while a callback of another bt_advance runs,
 * and waits for its lock; that callback stops the core.  Y must not run a
 * pass then: no timer runs after the stop.  (An earlier core checked the
 * stop flag only before taking the lock: Y ran a full pass after the stop
 * and fired a timer.) */
static struct {
    bt_timer_thread *tt;
    _Atomic int64_t y_rc;
    _Atomic int y_reached, later_runs;
    pthread_t y;
} race;

static void *advance_later(void *arg) {
    (void)arg;
    announce_locks = 1;
    atomic_store(&race.y_rc, bt_advance(race.tt, 3000));
    return NULL;
}

static void start_y_then_stop(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    atomic_store(&reached_mutex, 0);
    atomic_store(&announced_mutex, &race.tt->pass_mutex);
    CHECK(pthread_create(&race.y, NULL, advance_later, NULL) == 0);
    /* Y is past bt_advance's first look at the flag, at the lock we hold. */
    atomic_store(&race.y_reached, wait_flag(&reached_mutex, 5000));
    CHECK(bt_stop(race.tt) == 0);
}

static void test_advance_waiting_for_the_lock_runs_nothing_after_a_stop(void) {
    watchdog(__func__);
    memset(&race, 0, sizeof(race));
    race.tt = manual_core(1000);
    uint64_t id;
    CHECK(bt_schedule_native(race.tt, 2000, start_y_then_stop, NULL, &id) == 0);
    CHECK(bt_schedule_native(race.tt, 2500, count, &race.later_runs, &id) == 0);
    CHECK(bt_advance(race.tt, 2000) == 1);
    pthread_join(race.y, NULL);
    atomic_store(&announced_mutex, NULL);
    printf("  a bt_advance that waited for the lock across a bt_stop: answered %lld, "
           "%d timer(s) ran after the stop\n",
           (long long)atomic_load(&race.y_rc), atomic_load(&race.later_runs));
    CHECK(atomic_load(&race.y_reached) == 1);
    CHECK(atomic_load(&race.y_rc) == -ESHUTDOWN);
    CHECK(atomic_load(&race.later_runs) == 0);
    CHECK(bt_drop_all(race.tt, NULL, NULL) == 1);
    bt_destroy(race.tt);
}

/* bt_stop from another thread while a bt_advance runs a callback: it
 * returns after that advance, as a threaded core's returns after the join,
 * so a bt_drop_all or bt_destroy after it never races the pass.  (An
 * earlier core returned at once.) */
static struct {
    bt_timer_thread *tt;
    _Atomic int started, done;
} slow;

static void slow_callback(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    atomic_store(&slow.started, 1);
    usleep(100000);
    atomic_store(&slow.done, 1);
}

static void *advance_slowly(void *arg) {
    (void)arg;
    bt_advance(slow.tt, 2000);
    return NULL;
}

static void test_stop_from_another_thread_waits_out_a_running_advance(void) {
    watchdog(__func__);
    memset(&slow, 0, sizeof(slow));
    slow.tt = manual_core(1000);
    uint64_t id;
    CHECK(bt_schedule_native(slow.tt, 2000, slow_callback, NULL, &id) == 0);
    pthread_t x;
    CHECK(pthread_create(&x, NULL, advance_slowly, NULL) == 0);
    CHECK(wait_flag(&slow.started, 5000));
    CHECK(bt_stop(slow.tt) == 0);
    int done = atomic_load(&slow.done);
    printf("  bt_stop from another thread returned %s the running advance's callback "
           "finished\n", done ? "after" : "BEFORE");
    CHECK(done == 1);
    pthread_join(x, NULL);
    bt_destroy(slow.tt);
}

/* ---- manual clock: a callback that re-enters its own core ------------------ */

/* bt_advance of its own core from a native callback answers -EDEADLK (the
 * pass is this thread's; it cannot run a second one inside itself), and
 * the pass goes on.  (An earlier core locked the advance mutex its thread
 * already held and hung.) */
static struct {
    bt_timer_thread *tt;
    _Atomic int64_t rc;
} self_adv;

static void advance_own_core(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    atomic_store(&self_adv.rc, bt_advance(self_adv.tt, 5000));
}

static void test_advance_from_its_own_callback_answers_edeadlk(void) {
    watchdog(__func__);
    self_adv.tt = manual_core(1000);
    atomic_store(&self_adv.rc, 12345);
    _Atomic int runs = 0;
    uint64_t id;
    CHECK(bt_schedule_native(self_adv.tt, 2000, advance_own_core, NULL, &id) == 0);
    CHECK(bt_schedule_native(self_adv.tt, 2000, count, &runs, &id) == 0);
    CHECK(bt_schedule_native(self_adv.tt, 5000, count, &runs, &id) == 0);
    CHECK(bt_advance(self_adv.tt, 2000) == 2);
    printf("  bt_advance of its own core from a callback answered %lld\n",
           (long long)atomic_load(&self_adv.rc));
    CHECK(atomic_load(&self_adv.rc) == -EDEADLK);
    CHECK(atomic_load(&runs) == 1);        /* the pass went on, at its own now */
    CHECK(bt_time_ns(self_adv.tt) == 2000); /* the clock did not move */
    CHECK(bt_advance(self_adv.tt, 5000) == 1);
    bt_destroy(self_adv.tt);
}

/* bt_next_deadline of its own core from a native callback answers, without
 * the lock its thread holds, the earliest live deadline: of a timer the
 * callback just scheduled (still in its bucket list), of a timer due in
 * this same pass, of a later one, as each is cancelled in turn.  (An
 * earlier core hung.) */
static struct {
    bt_timer_thread *tt;
    uint64_t due, later;
    int64_t seen[3];
    _Atomic int stray; /* runs of the timer the callback schedules and cancels */
} self_next;

static void ask_own_next_deadline(void *arg, uint64_t id) {
    (void)arg;
    (void)id;
    uint64_t fresh;
    CHECK(bt_schedule_native(self_next.tt, 1800, count, &self_next.stray, &fresh) == 0);
    self_next.seen[0] = bt_next_deadline(self_next.tt);
    CHECK(bt_cancel(self_next.tt, fresh) == BT_CANCELLED);
    self_next.seen[1] = bt_next_deadline(self_next.tt);
    CHECK(bt_cancel(self_next.tt, self_next.due) == BT_CANCELLED);
    self_next.seen[2] = bt_next_deadline(self_next.tt);
}

static void test_next_deadline_from_its_own_callback_answers_without_the_lock(void) {
    watchdog(__func__);
    memset(&self_next, 0, sizeof(self_next));
    self_next.tt = manual_core(1000);
    _Atomic int runs = 0;
    uint64_t id;
    CHECK(bt_schedule_native(self_next.tt, 2000, ask_own_next_deadline, NULL, &id) == 0);
    CHECK(bt_schedule_native(self_next.tt, 2000, count, &runs, &self_next.due) == 0);
    CHECK(bt_schedule_native(self_next.tt, 5000, count, &runs, &self_next.later) == 0);
    CHECK(bt_advance(self_next.tt, 2000) == 1); /* the other one at 2000 was cancelled */
    printf("  bt_next_deadline of its own core from a callback: %lld, %lld, %lld\n",
           (long long)self_next.seen[0], (long long)self_next.seen[1],
           (long long)self_next.seen[2]);
    CHECK(self_next.seen[0] == 1800);
    CHECK(self_next.seen[1] == 2000);
    CHECK(self_next.seen[2] == 5000);
    CHECK(bt_next_deadline(self_next.tt) == 5000);
    CHECK(bt_advance(self_next.tt, 5000) == 1);
    CHECK(atomic_load(&runs) == 1);
    CHECK(atomic_load(&self_next.stray) == 0);
    bt_destroy(self_next.tt);
}

/* ---- deadlines at the ends of the int64 range -------------------------------- */

/* bt_deadline_after saturates both ways for every `now`, negative ones
 * included (a manual clock may start anywhere).  UBSan (nox -s asan) fails
 * on any signed overflow.  (An earlier core computed INT64_MAX - now, which
 * overflows for now < 0: half a second after -1 ns was "never".) */
static void test_deadline_after_saturates_for_every_now(void) {
    watchdog(__func__);
    const int64_t lo = INT64_MIN, hi = INT64_MAX;
    int64_t got[] = {
        bt_deadline_after(-1, 0.5),
        bt_deadline_after(-1000000000, 0.5),
        bt_deadline_after(lo, 0.5),
        bt_deadline_after(lo, -0.5),
        bt_deadline_after(lo, -1e300),
        bt_deadline_after(lo, 1e300),
        bt_deadline_after(hi, 0.5),
        bt_deadline_after(hi, -0.5),
        bt_deadline_after(hi, 1e300),
        bt_deadline_after(hi, -1e300),
        bt_deadline_after(lo + 5, -9.1e9),
        bt_deadline_after(hi - 5, 9.1e9),
        bt_deadline_after(0, 9.1e9),
        bt_deadline_after(0, -9.1e9),
    };
    int64_t want[] = {
        499999999,
        -500000000,
        lo + 500000000,
        lo,
        lo,
        hi,
        hi,
        hi - 500000000,
        hi,
        hi + (int64_t)-9.2e18,
        lo,
        hi,
        9100000000000000000LL,
        -9100000000000000000LL,
    };
    int wrong = 0;
    for (size_t i = 0; i < sizeof(got) / sizeof(got[0]); i++) {
        if (got[i] == want[i]) continue;
        printf("  bt_deadline_after case %zu: %lld, expected %lld\n", i, (long long)got[i],
               (long long)want[i]);
        wrong++;
    }
    CHECK(wrong == 0);
}

/* ---- errors on the way in and out (failure injection: internal.h) -------- */

/* bt_create whose slot pool fails to initialise answers that error and
 * leaves nothing made: no core, no thread, no id tag kept (after twice as
 * many failures as there are tags, 63 live cores still each have their
 * own), no memory (ASan's leak check).  (An earlier core ignored the
 * error and handed out a core with an unusable pool.) */
static void test_create_whose_pool_init_fails_leaves_nothing(void) {
    watchdog(__func__);
    int threads = thread_count(), refused = 0, made = 0;
    for (uint32_t i = 0; i < 2 * BT_TAGS; i++) {
        bt_options o;
        bt_options_init(&o);
        o.manual_clock = (int32_t)(i & 1);
        bt_timer_thread *tt = NULL;
        atomic_store(&bt__faults[BT_FAULT_POOL_INIT], EAGAIN);
        int rc = bt_create(&o, &tt);
        if (rc == -EAGAIN && tt == NULL) refused++;
        if (rc == 0 && tt) {
            made++;
            bt_destroy(tt);
        }
    }
    int threads_after = thread_count();
    static bt_timer_thread *cores[BT_TAGS];
    int own_tag = 0;
    for (uint32_t i = 0; i < BT_TAGS; i++) {
        cores[i] = manual_core(0);
        own_tag += cores[i] && cores[i]->tag_owned;
    }
    for (uint32_t i = 0; i < BT_TAGS; i++) bt_destroy(cores[i]);
    printf("  %u creates whose pool failed: %d answered -EAGAIN, %d made a core anyway; "
           "then %d of %u live cores had a tag of their own\n",
           2 * BT_TAGS, refused, made, own_tag, BT_TAGS);
    CHECK(refused == 2 * BT_TAGS);
    CHECK(made == 0);
    CHECK(threads_after == threads);
    CHECK(own_tag == BT_TAGS);
}

/* A join that fails leaves the thread counted as running: bt_stop (here
 * inside bt_destroy) reports the error, bt_destroy refuses to free the
 * core, and the next bt_stop joins it. */
static void test_failed_join_is_reported_and_destroy_refuses(void) {
    watchdog(__func__);
    bt_timer_thread *tt = threaded_core();
    atomic_store(&bt__faults[BT_FAULT_JOIN], EINVAL);
    int destroy_rc = bt_destroy(tt);
    CHECK(destroy_rc == -EINVAL);
    CHECK(tt->started == 1); /* not marked joined */
    CHECK(bt_is_stopped(tt));
    uint64_t id;
    CHECK(bt_schedule_native(tt, 0, count, NULL, &id) == -ESHUTDOWN); /* still there */
    int stop_rc = bt_stop(tt);
    CHECK(stop_rc == 0);
    CHECK(tt->started == 0);
    printf("  a join that failed: bt_destroy answered %d and kept the core; the next "
           "bt_stop answered %d\n", destroy_rc, stop_rc);
    CHECK(bt_destroy(tt) == 0);
}

int main(int argc, char **argv) {
    /* Line by line: a crash (what an earlier core did here) keeps what was
     * printed before it. */
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct test all[] = {
        {"stop_of_an_outer_threaded_core_from_a_nested_callback",
         test_stop_of_an_outer_threaded_core_from_a_nested_callback},
        {"destroy_of_an_outer_manual_core_from_a_nested_callback",
         test_destroy_of_an_outer_manual_core_from_a_nested_callback},
        {"advance_waiting_for_the_lock_runs_nothing_after_a_stop",
         test_advance_waiting_for_the_lock_runs_nothing_after_a_stop},
        {"stop_from_another_thread_waits_out_a_running_advance",
         test_stop_from_another_thread_waits_out_a_running_advance},
        {"advance_from_its_own_callback_answers_edeadlk",
         test_advance_from_its_own_callback_answers_edeadlk},
        {"next_deadline_from_its_own_callback_answers_without_the_lock",
         test_next_deadline_from_its_own_callback_answers_without_the_lock},
        {"deadline_after_saturates_for_every_now", test_deadline_after_saturates_for_every_now},
        {"create_whose_pool_init_fails_leaves_nothing",
         test_create_whose_pool_init_fails_leaves_nothing},
        {"failed_join_is_reported_and_destroy_refuses",
         test_failed_join_is_reported_and_destroy_refuses},
    };
    /* Arguments: run only the tests named. */
    struct test tests[sizeof(all) / sizeof(all[0])];
    size_t n = 0;
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        int chosen = argc < 2;
        for (int a = 1; a < argc; a++) chosen |= strcmp(argv[a], all[i].name) == 0;
        if (chosen) tests[n++] = all[i];
    }
    int rc = run_tests(tests, n);
    alarm(0);
    return rc;
}
