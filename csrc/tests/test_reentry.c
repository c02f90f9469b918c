/*
 * test_reentry.c -- the edges of the core's lifecycle and clock arithmetic:
 * deadlines computed at the ends of the int64 range.  Run by ctest, under
 * TSan and under ASan+UBSan.  A test that hangs is ended by SIGALRM
 * (watchdog below), which prints its name and fails the program.
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

int main(int argc, char **argv) {
    /* Line by line: a crash (what an earlier core did here) keeps what was
     * printed before it. */
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct test all[] = {
        {"deadline_after_saturates_for_every_now", test_deadline_after_saturates_for_every_now},
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
