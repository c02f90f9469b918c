/*
 * module.h -- what the files of bucketimer._core share: the module state,
 * the layouts of the objects more than one file touches, and the functions
 * one file calls in another.  docs/design.rst ("The CPython module") maps
 * which file owns what.
 */
#ifndef BT_EXT_MODULE_H
#define BT_EXT_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>

#include "bucketimer.h"
#include "compat.h"

static inline PyObject *tuple_from_array(PyObject *const *items, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(items[i]));
    return t;
}

/* ---- module state ------------------------------------------------------- */

typedef struct {
    PyTypeObject *TimerThread_Type;
    PyTypeObject *Handle_Type;
    PyTypeObject *Port_Type;
    PyObject *get_running_loop; /* asyncio's C _get_running_loop */
    PyObject *str_port_for;     /* "_port_for" */
    PyTypeObject *Scheduler_Type;
    PyTypeObject *Timeout_Type;
    PyTypeObject *Ready_Type;
    PyObject *ready_none;        /* an awaitable that returns None at once */
    PyObject *ready_spare;       /* a free Ready object (owned, not initialised), or NULL */
    PyObject *stop_iteration;    /* the StopIteration raise_stop_iteration reuses */
#define TIMEOUT_FREELIST_MAX 16
    struct TimeoutObject *timeout_free[TIMEOUT_FREELIST_MAX]; /* dead, kept for reuse */
    int timeout_nfree;
    PyTypeObject *WaitFor_Type;  /* 3.12 and later */
    getter coro_await_getter;    /* the coroutine type's cr_await, read directly */
    PyTypeObject *task_type;     /* asyncio.Task (the C one when present) */
    PyObject *task_cancelling;   /* its cancelling method descriptor */
    PyObject *wait_for_nonpositive; /* aio._wait_for_nonpositive */
    PyObject *str_cr_await, *str_close, *str_throw;
    PyObject *current_tasks;     /* asyncio's loop -> current task dict, or NULL */
    PyObject *current_task;      /* asyncio.current_task */
    PyObject *CancelledError;
    PyObject *ExceptionGroup;
    PyObject *insert_timeout_error; /* 3.13's Timeout._insert_timeout_error, or NULL */
    PyObject *default_factory;   /* bucketimer.default_timer_thread */
    PyObject *default_tt;        /* what it last returned */
    PyObject *str_time, *str_call_soon, *str_cancelling, *str_uncancel, *str_cancel;
    PyObject *stock_time;            /* asyncio.BaseEventLoop.time */
    PyTypeObject *time_checked_type; /* last loop type looked at (borrowed id) */
    int time_checked_is_stock;
    PyObject *str_running_loop_key;  /* where _asyncio keeps it, up to 3.12 */
#if PY_VERSION_HEX < 0x030C0000
    PyTypeObject *holder_type;  /* _asyncio._RunningLoopHolder, once seen */
#endif
    /* 3.13: whether the loop found right after the PyThreadState proved to
     * be _get_running_loop()'s answer: 0 not yet seen, 1 yes, -1 no */
    int tstate_loop_ok;
} core_state;

static inline core_state *get_state(PyObject *module) {
    return (core_state *)PyModule_GetState(module);
}

extern struct PyModuleDef core_module;

/* ---- objects ------------------------------------------------------------ */

enum handle_state { H_PENDING = 0, H_CANCELLED = 1, H_RAN = 2, H_DROPPED = 3 };

typedef struct TimerThreadObject TimerThreadObject;

typedef struct {
    PyObject_HEAD
    bt_port *port;
    TimerThreadObject *tt; /* strong: keeps the core alive */
    PyObject *loop;        /* the loop it serves, or None (dispatcher) */
    PyObject *on_error;    /* on_error(handle, exc), or None */
    int drop;              /* drain releases without running (orphans) */
    _Atomic int draining;
    PyObject *weakreflist;
} PortObject;

typedef struct {
    PyObject_HEAD
    TimerThreadObject *tt; /* strong */
    PortObject *port;      /* strong */
    uint64_t id;
    double when;
    PyObject *callback;    /* NULL once finished */
    PyObject *args;
    PyObject *context;
    _Atomic int state;
    /* asyncio.TimerHandle semantics (the drop-in loop's handles): cancel()
     * returns None, and cancelled() is True once cancel() was called, even
     * if the callback had already run. */
    int compat;
    int cancel_called;
    /* the callback is a Timeout whose expiry this runs (no bound method) */
    int is_timeout;
    PyObject *weakreflist;
} HandleObject;

struct TimerThreadObject {
    PyObject_HEAD
    bt_timer_thread *core;
    core_state *state;
    /* Last (loop -> port) resolved, so a loop's timers skip the dict.
     * Only used with the GIL: free-threaded builds always call _port_for. */
    PyObject *cached_loop;
    PortObject *cached_port;
    PortObject *dispatcher; /* the port of loop None, once created */
    int closed;
    PyObject *weakreflist;
};


enum { T_CREATED, T_ENTERED, T_EXPIRING, T_EXPIRED, T_EXITED };

typedef struct TimeoutObject {
    PyObject_HEAD
    core_state *st;
    int state;
    long cancelling;
    PyObject *when;     /* a number, or None */
    PyObject *handler;  /* our Handle, or the loop's call_soon handle */
    PyObject *task;
    PyObject *on_timeout; /* bound _on_timeout, made on first arming */
    PyObject *weakreflist;
} TimeoutObject;


/* ---- types (their specs, added to the module by module.c) --------------- */

extern PyType_Spec Handle_spec, Port_spec, TimerThread_spec, Scheduler_spec, Ready_spec,
    Timeout_spec, WaitFor_spec;

/* ---- across files ------------------------------------------------------- */

/* compat.c */
void running_loop_init(void);
PyObject *running_loop(core_state *st);
PyObject *raise_stop_iteration(core_state *st, PyObject *value);
void forget_stop_iteration(core_state *st, PyObject *value);

/* timer_thread.c */
PyObject *raise_errno(int rc, const char *what);
int to_seconds(PyObject *o, const char *what, double *out);
int check_open(TimerThreadObject *self);
PortObject *port_for(TimerThreadObject *self, PyObject *loop);
int parse_schedule_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                        int absolute, PyObject **loop, PyObject **context);
/* flags for schedule_resolved */
#define SCHED_COMPAT 1  /* asyncio.TimerHandle semantics */
#define SCHED_TIMEOUT 2 /* cb is a Timeout: expire it */
PyObject *schedule_resolved(TimerThreadObject *self, int absolute, double t, PyObject *cb,
                            PyObject *const *cbargs, Py_ssize_t ncbargs, PyObject *loop,
                            PyObject *context, int flags);
TimerThreadObject *default_tt(core_state *st);

/* handle.c */
HandleObject *handle_alloc(PyTypeObject *tp);
void handle_release_callback(HandleObject *self);
int handle_cancel(HandleObject *self);
void drop_handle(void *ctx, bt_port *port, void *payload);

/* port.c */
PortObject *port_new(TimerThreadObject *tt, bt_port *p, PyObject *loop, int drop);

/* scheduler.c */
PyObject *TimerThread_scheduler(TimerThreadObject *self, PyObject *args);

/* timeout.c */
PyObject *ready_new(core_state *st, PyObject *value);
PyObject *throw_args_exception(PyObject *const *args, Py_ssize_t nargs);
PyObject *need_running_loop(core_state *st);
PyObject *timeout_on_loop(core_state *st, PyObject *loop, PyObject *delay, int64_t *now_ns);
int timeout_enter(TimeoutObject *self, PyObject *loop, int64_t now_ns);
PyObject *Timeout_aexit(TimeoutObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *timeout_fire(PyObject *timeout);
PyObject *core_timeout(PyObject *m, PyObject *delay);
PyObject *core_timeout_at(PyObject *m, PyObject *when);

/* wait_for.c (3.12 and later) */
PyObject *core_wait_for(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *core_set_wait_for_nonpositive(PyObject *m, PyObject *fn);

#endif
