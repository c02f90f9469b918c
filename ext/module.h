/*
 * module.h -- what the files of bucketimer._core share: the module state,
 * the layouts of the objects more than one file touches, and the functions
 * one file calls in another.  Every field here is read and written with the
 * GIL held (the _Atomic ones too: they are atomic for a free-threaded
 * build's sake); the core sees a Handle only as an opaque payload.  The
 * table in docs/design.rst ("The data path") maps which file owns what.
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
#include "freelist.h"

static inline PyObject *tuple_from_array(PyObject *const *items, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(items[i]));
    return t;
}

/* ---- strong references, listed once per type ------------------------------ */

/* Each object type lists the fields that hold strong references once, as an
 * X-macro (e.g. HANDLE_REFS below); BT_GC_TRAVERSE and BT_GC_CLEAR write its
 * tp_traverse and tp_clear from that list, so the two cannot disagree.  A
 * new PyObject field goes in its type's list. */
#define BT_VISIT_REF(field) Py_VISIT(self->field);
#define BT_CLEAR_REF(field) Py_CLEAR(self->field);
#define BT_GC_TRAVERSE(Name, Object, REFS)                                 \
    static int Name##_traverse(Object *self, visitproc visit, void *arg) { \
        Py_VISIT(Py_TYPE(self));                                           \
        REFS(BT_VISIT_REF)                                                 \
        return 0;                                                          \
    }
#define BT_GC_CLEAR(Name, Object, REFS) \
    static int Name##_clear(Object *self) { \
        REFS(BT_CLEAR_REF)                  \
        return 0;                           \
    }

/* ---- module state ------------------------------------------------------- */

#define HANDLE_FREELIST 256 /* a burst of call_later+cancel pairs */
#define TIMEOUT_FREELIST 16 /* nested `async with timeout()` blocks */
#define STEP_FREELIST 2     /* __aenter__'s, then __aexit__'s */

typedef struct {
    /* types */
    PyTypeObject *TimerThread_Type, *Handle_Type, *Port_Type, *Scheduler_Type;
    PyTypeObject *Timeout_Type, *Step_Type, *WaitFor_Type; /* WaitFor: 3.12+ */
    PyTypeObject *GrpcUnary_Type, *GrpcCall_Type;           /* grpc_call.c */
    /* CPython's private state, read through compat.c */
    bt_compat compat;
    /* asyncio's objects that the helpers call or compare with */
    PyTypeObject *task_type;   /* asyncio.Task (the C one when present) */
    PyObject *task_cancelling; /* its cancelling() method descriptor */
    PyObject *CancelledError;
    PyObject *ExceptionGroup;
    PyObject *stock_time;      /* asyncio.BaseEventLoop.time */
    /* bucketimer's Python side, registered when bucketimer is imported */
    PyObject *default_factory;      /* bucketimer.default_timer_thread */
    PyObject *wait_for_nonpositive; /* aio._wait_for_nonpositive (3.12+) */
    /* caches, written with the GIL held */
    PyObject *default_tt;            /* what default_factory last returned */
    PyTypeObject *time_checked_type; /* the last loop type looked at (only compared) */
    int time_checked_is_stock;       /* ... and whether it has the stock time() */
    /* free lists (freelist.h) and their storage */
    bt_freelist handles, timeouts, steps;
    PyObject *handle_store[HANDLE_FREELIST];
    PyObject *timeout_store[TIMEOUT_FREELIST];
    PyObject *step_store[STEP_FREELIST];
    /* interned names */
    PyObject *str_port_for, *str_time, *str_call_soon, *str_cancel, *str_cancelling;
    PyObject *str_uncancel, *str_close, *str_throw, *str_exceptions;
} core_state;

/* The state's strong references (module.c's traverse and clear) and its
 * interned names with their text (created and cleared by module.c). */
#define CORE_TYPES(X) \
    X(TimerThread_Type) X(Handle_Type) X(Port_Type) X(Scheduler_Type) X(Timeout_Type) \
    X(Step_Type) X(WaitFor_Type) X(GrpcUnary_Type) X(GrpcCall_Type)
#define CORE_OBJECTS(X)                                                            \
    X(task_type) X(task_cancelling) X(CancelledError) X(ExceptionGroup) X(stock_time) \
    X(default_factory) X(wait_for_nonpositive) X(default_tt)
#define CORE_NAMES(X)                                                                  \
    X(str_port_for, "_port_for") X(str_time, "time") X(str_call_soon, "call_soon")      \
    X(str_cancel, "cancel") X(str_cancelling, "cancelling") X(str_uncancel, "uncancel") \
    X(str_close, "close") X(str_throw, "throw") X(str_exceptions, "exceptions")

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
#define PORT_REFS(X) X(loop) X(on_error) X(tt)

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
#define HANDLE_REFS(X) X(tt) X(port) X(callback) X(args) X(context)

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
    /* A close() whose join failed: the core is stopped (nothing runs, nothing
     * can be scheduled) but its thread lives and its timers are kept; the
     * next close() tries again (timer_thread.c, close_core). */
    int stop_failed;
    PyObject *weakreflist;
};
#define TIMERTHREAD_REFS(X) X(cached_loop) X(cached_port) X(dispatcher)


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
    PyObject *step;       /* the Step __aenter__ returned, kept to serve __aexit__ */
    PyObject *weakreflist;
} TimeoutObject;
#define TIMEOUT_REFS(X) X(when) X(handler) X(task) X(on_timeout) X(step)


/* ---- types (their specs, added to the module by module.c) --------------- */

extern PyType_Spec Handle_spec, Port_spec, TimerThread_spec, Scheduler_spec, Step_spec,
    Timeout_spec, WaitFor_spec, GrpcUnary_spec, GrpcCall_spec;

/* ---- across files ------------------------------------------------------- */

/* schedule.c */
PyObject *raise_errno(int rc, const char *what);
/* A delay or deadline as seconds: TypeError for what is not a real number
 * (bool, str, None...), ValueError for NaN; beyond the double range, +-inf. */
int to_seconds(PyObject *o, const char *what, double *out);
/* (time, callback, *args) and the keywords context= and, where `loop` is
 * not NULL, loop=. */
int parse_schedule_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                        int absolute, PyObject **loop, PyObject **context);
/* The port of `loop` (None: the dispatcher), a new reference. */
PortObject *port_for(TimerThreadObject *self, PyObject *loop);
#define SCHED_COMPAT 1  /* asyncio.TimerHandle semantics */
#define SCHED_TIMEOUT 2 /* cb is a Timeout: expire it */
/* The common tail of every way to schedule: `t` is a parsed delay or
 * deadline (`absolute`), `loop` the loop it goes to (None: the dispatcher).
 * A new Handle, or NULL. */
PyObject *schedule_resolved(TimerThreadObject *self, int absolute, double t, PyObject *cb,
                            PyObject *const *cbargs, Py_ssize_t ncbargs, PyObject *loop,
                            PyObject *context, int flags);

/* timer_thread.c */
int check_open(TimerThreadObject *self);
/* The process default TimerThread (borrowed), made anew once closed. */
TimerThreadObject *default_tt(core_state *st);

/* handle.c */
/* A Handle for cb(*args) delivered through `port` (a reference it takes
 * over), in `context` (NULL: a copy of the current one; a Timeout's expiry
 * needs none). */
HandleObject *handle_new(TimerThreadObject *tt, PortObject *port, double when, PyObject *cb,
                         PyObject *const *args, Py_ssize_t nargs, PyObject *context, int flags);
/* A Handle the core refused: both its references dropped. */
void handle_abandon(HandleObject *h);
void handle_release_callback(HandleObject *self);
int handle_cancel(HandleObject *self);
void drop_handle(void *ctx, bt_port *port, void *payload);

/* port.c */
PortObject *port_new(TimerThreadObject *tt, bt_port *p, PyObject *loop, int drop);

/* scheduler.c */
PyObject *TimerThread_scheduler(TimerThreadObject *self, PyObject *args);

/* timeout.c */
PyObject *throw_args_exception(PyObject *const *args, Py_ssize_t nargs);
PyObject *need_running_loop(core_state *st);
PyObject *timeout_on_loop(core_state *st, PyObject *loop, PyObject *delay, int64_t *now_ns);
int timeout_enter(TimeoutObject *self, PyObject *loop, int64_t now_ns);
int timeout_exit(TimeoutObject *self, PyObject *exc_type, PyObject *exc_val);
PyObject *timeout_fire(PyObject *timeout);
PyObject *core_timeout(PyObject *m, PyObject *delay);
PyObject *core_timeout_at(PyObject *m, PyObject *when);

/* wait_for.c (3.12 and later) */
PyObject *core_wait_for(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *core_set_wait_for_nonpositive(PyObject *m, PyObject *fn);

#endif
