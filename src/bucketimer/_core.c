/*
 * _core.c -- the CPython face of the native core.
 *
 * Types (heap types, one module state, multi-phase init):
 *   TimerThread  owns one bt_timer_thread.  call_later / call_at are the hot
 *                path: parse, capture the context, pick the port, schedule.
 *   Handle       one scheduled callback.  While PENDING or POSTED the core's
 *                slot owns a strong reference to it (taken at schedule).  The
 *                thread that moves it to a terminal state drops that
 *                reference, always with the GIL (or, free-threaded, as the
 *                only winner of the CAS): cancel() when it wins, the port's
 *                consumer after running it, close() for dropped timers.
 *   Port         a bt_port: where due timers of one event loop (or of the
 *                dispatcher thread) wait.  drain() runs them.
 *
 * The timer thread itself never takes the GIL: it sees Handles only as
 * opaque payload pointers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>

#include "bucketimer.h"

/* ---- compatibility: 3.11 lacks a few 3.12 spellings ------------------- */

#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h>
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_READONLY READONLY
static PyObject *PyErr_GetRaisedException(void) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!t) return NULL;
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb) PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
}
static void PyErr_SetRaisedException(PyObject *exc) {
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}
#endif

static PyObject *tuple_from_array(PyObject *const *items, Py_ssize_t n) {
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

static PyObject *raise_errno(int rc, const char *what) {
    if (rc == -ENOMEM) return PyErr_NoMemory();
    if (rc == -ESHUTDOWN) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is closed");
        return NULL;
    }
    if (rc == -ECHILD) {
        PyErr_SetString(PyExc_RuntimeError,
                        "TimerThread was created in a parent process; its thread does not "
                        "exist after fork()");
        return NULL;
    }
    errno = -rc;
    PyErr_Format(PyExc_OSError, "%s failed: %s", what, strerror(-rc));
    return NULL;
}

/* ---- the running loop ----------------------------------------------------
 * asyncio's C _get_running_loop on 3.11 calls getpid() on every call (a
 * syscall since glibc stopped caching it) to hide a parent's loop from a
 * forked child.  That is a third of a schedule+cancel pair.  On 3.11 we read
 * the same per-thread holder asyncio reads and compare its pid with one we
 * cache and refresh after fork().  3.12 keeps the loop itself
 * under the same key (no pid check); a dict lookup there is three times
 * cheaper than calling _get_running_loop.  3.13 moved it into the
 * thread state, in the word that follows the public PyThreadState
 * (_PyThreadStateImpl.asyncio_running_loop, which _asyncio reads and writes
 * directly).  We read that word only once it has been seen to hold exactly
 * what _get_running_loop() returned; until then, and for good if it ever
 * did not, we call the function.  (Free-threaded builds always call it.) */

#if PY_VERSION_HEX < 0x030C0000
#include <unistd.h>
typedef struct {
    PyObject_HEAD
    PyObject *rl_loop;
    pid_t rl_pid;
} running_loop_holder; /* _asynciomodule.c, 3.11 */

static _Atomic pid_t cached_pid;
static void refresh_pid(void) { atomic_store(&cached_pid, getpid()); }
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;
static void install_pid_cache(void) {
    refresh_pid();
    pthread_atfork(NULL, NULL, refresh_pid);
}
#endif

/* New reference to the running loop of this thread, or to None. */
static PyObject *running_loop(core_state *st) {
#if PY_VERSION_HEX < 0x030C0000
    PyObject *d = PyThreadState_GetDict();
    if (d) {
        PyObject *holder = PyDict_GetItemWithError(d, st->str_running_loop_key);
        if (!holder) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
        if (!st->holder_type &&
            strstr(Py_TYPE(holder)->tp_name, "_RunningLoopHolder") != NULL &&
            Py_TYPE(holder)->tp_basicsize == sizeof(running_loop_holder))
            st->holder_type = (PyTypeObject *)Py_NewRef(Py_TYPE(holder));
        if (Py_TYPE(holder) == st->holder_type) {
            running_loop_holder *h = (running_loop_holder *)holder;
            if (h->rl_pid != atomic_load_explicit(&cached_pid, memory_order_relaxed))
                Py_RETURN_NONE;
            return Py_NewRef(h->rl_loop);
        }
    }
#elif PY_VERSION_HEX < 0x030D0000
    PyObject *d = PyThreadState_GetDict();
    if (d) {
        PyObject *loop = PyDict_GetItemWithError(d, st->str_running_loop_key);
        if (loop) return Py_NewRef(loop);
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
#elif PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
    PyObject **slot = (PyObject **)((char *)PyThreadState_Get() + sizeof(PyThreadState));
    if (st->tstate_loop_ok > 0) return Py_NewRef(*slot ? *slot : Py_None);
    PyObject *loop = PyObject_CallNoArgs(st->get_running_loop);
    if (loop && loop != Py_None && st->tstate_loop_ok == 0)
        st->tstate_loop_ok = *slot == loop ? 1 : -1;
    return loop;
#endif
    return PyObject_CallNoArgs(st->get_running_loop);
}

/* ---- time parsing ------------------------------------------------------- */

/* Converts a delay or deadline to a double; TypeError for non-numbers (str,
 * bytes, None, bool), ValueError for NaN. */
static int to_seconds(PyObject *o, const char *what, double *out) {
    double v;
    if (PyFloat_CheckExact(o)) {
        v = PyFloat_AS_DOUBLE(o);
    } else if (PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a real number, not bool", what);
        return -1;
    } else if (PyLong_Check(o) || PyFloat_Check(o) ||
               (Py_TYPE(o)->tp_as_number && (Py_TYPE(o)->tp_as_number->nb_float ||
                                             Py_TYPE(o)->tp_as_number->nb_index))) {
        v = PyFloat_AsDouble(o);
        if (v == -1.0 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                /* A number beyond the double range (a huge int or
                 * Fraction): forever if positive, at once if negative.  If
                 * it cannot even say its sign, the OverflowError stands. */
                PyObject *exc = PyErr_GetRaisedException();
                PyObject *zero = PyLong_FromLong(0);
                int neg = zero ? PyObject_RichCompareBool(o, zero, Py_LT) : -1;
                Py_XDECREF(zero);
                if (neg < 0) {
                    PyErr_Clear();
                    PyErr_SetRaisedException(exc);
                    return -1;
                }
                Py_DECREF(exc);
                v = neg ? -INFINITY : INFINITY;
            } else {
                return -1;
            }
        }
    } else {
        PyErr_Format(PyExc_TypeError, "%s must be a real number, not %.100s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    if (isnan(v)) {
        PyErr_Format(PyExc_ValueError, "%s must not be NaN", what);
        return -1;
    }
    *out = v;
    return 0;
}

/* Seconds on the monotonic clock -> ns, rounded up so that a timer never
 * fires before time.monotonic() reaches `when`.  +inf and anything past the
 * int64 range means never (INT64_MAX); -inf means as soon as possible. */
static int64_t when_to_ns(double when) {
    if (when >= 9.2e9) return INT64_MAX;
    if (when <= -9.2e9) return INT64_MIN / 2;
    return (int64_t)ceil(when * 1e9);
}

/* ---- Handle ------------------------------------------------------------- */

static int Handle_traverse(HandleObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->tt);
    Py_VISIT(self->port);
    Py_VISIT(self->callback);
    Py_VISIT(self->args);
    Py_VISIT(self->context);
    return 0;
}

static int Handle_clear(HandleObject *self) {
    Py_CLEAR(self->tt);
    Py_CLEAR(self->port);
    Py_CLEAR(self->callback);
    Py_CLEAR(self->args);
    Py_CLEAR(self->context);
    return 0;
}

/* A small free list of Handle objects: a schedule+cancel pair then costs no
 * allocation and no step towards a GC collection.  Only with the GIL, which
 * serialises it; free-threaded builds allocate every time. */
#ifndef Py_GIL_DISABLED
#define HANDLE_FREELIST_MAX 256
static HandleObject *handle_freelist[HANDLE_FREELIST_MAX];
static int handle_freelist_len;
#endif

static void Handle_dealloc(HandleObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    Handle_clear(self);
#ifndef Py_GIL_DISABLED
    if (handle_freelist_len < HANDLE_FREELIST_MAX && Py_IS_TYPE(self, tp) &&
        !(tp->tp_flags & Py_TPFLAGS_BASETYPE)) {
        handle_freelist[handle_freelist_len++] = self;
        Py_DECREF(tp); /* PyObject_Init takes it again on reuse */
        return;
    }
#endif
    tp->tp_free(self);
    Py_DECREF(tp);
}

static HandleObject *handle_alloc(PyTypeObject *tp) {
#ifndef Py_GIL_DISABLED
    if (handle_freelist_len > 0) {
        HandleObject *h = handle_freelist[--handle_freelist_len];
        if (Py_TYPE(h) == tp) {
            (void)PyObject_Init((PyObject *)h, tp);
            return h;
        }
        /* another interpreter's (or a reloaded module's) type: let it go */
        PyObject_GC_Del(h);
    }
#endif
    return PyObject_GC_New(HandleObject, tp);
}

/* Drops what a finished handle no longer needs (the tt and port stay, so
 * cancel() after the fact still has something to ask). */
static void handle_release_callback(HandleObject *self) {
    PyObject *cb = self->callback, *args = self->args, *ctx = self->context;
    self->callback = self->args = self->context = NULL;
    Py_XDECREF(cb);
    Py_XDECREF(args);
    Py_XDECREF(ctx);
}

/* 1 if this call won the cancel, 0 if not. */
static int handle_cancel(HandleObject *self) {
    if (atomic_load_explicit(&self->state, memory_order_acquire) != H_PENDING || !self->tt)
        return 0;
    int rc = bt_cancel(self->tt->core, self->id);
    if (rc != BT_CANCELLED) return 0;
    /* We won the core's CAS: nobody else will touch the callback, and the
     * slot's reference to us is ours to drop. */
    atomic_store_explicit(&self->state, H_CANCELLED, memory_order_release);
    handle_release_callback(self);
    Py_DECREF(self); /* the slot's reference; the caller still holds one */
    return 1;
}

static PyObject *Handle_cancel(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->compat) {
        self->cancel_called = 1;
        handle_cancel(self);
        Py_RETURN_NONE;
    }
    return PyBool_FromLong(handle_cancel(self));
}

static PyObject *Handle_cancelled(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(atomic_load(&self->state) == H_CANCELLED ||
                           (self->compat && self->cancel_called));
}

static PyObject *Handle_when(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyFloat_FromDouble(self->when);
}

static PyObject *Handle_get_context(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->context) Py_RETURN_NONE;
    return Py_NewRef(self->context);
}

static PyObject *Handle_get_id(HandleObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLongLong(self->id);
}

static PyObject *Handle_get_loop(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->port) Py_RETURN_NONE;
    return Py_NewRef(self->port->loop);
}

static PyObject *Handle_get_callback(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->callback) Py_RETURN_NONE;
    return Py_NewRef(self->callback);
}

static PyObject *Handle_get_args(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->args) Py_RETURN_NONE;
    return Py_NewRef(self->args);
}

static PyObject *Handle_repr(HandleObject *self) {
    static const char *names[] = {"pending", "cancelled", "ran", "dropped"};
    int st = atomic_load(&self->state);
    if (self->callback) {
        PyObject *when = PyFloat_FromDouble(self->when);
        if (!when) return NULL;
        PyObject *r = PyUnicode_FromFormat("<bucketimer.Handle %s when=%R %R>", names[st], when,
                                           self->callback);
        Py_DECREF(when);
        return r;
    }
    return PyUnicode_FromFormat("<bucketimer.Handle %s id=%llu>", names[st],
                                (unsigned long long)self->id);
}

static PyMethodDef Handle_methods[] = {
    {"cancel", (PyCFunction)Handle_cancel, METH_NOARGS,
     "cancel() -> bool\n\nTrue iff this call guaranteed the callback never runs. False if it "
     "is running, has run, was cancelled or dropped before, or its TimerThread is closed."},
    {"cancelled", (PyCFunction)Handle_cancelled, METH_NOARGS,
     "True iff a cancel() of this handle won."},
    {"when", (PyCFunction)Handle_when, METH_NOARGS,
     "The deadline, in time.monotonic() seconds."},
    {"get_context", (PyCFunction)Handle_get_context, METH_NOARGS,
     "The contextvars.Context the callback runs in (None once finished)."},
    {NULL}};

static PyGetSetDef Handle_getset[] = {
    {"id", (getter)Handle_get_id, NULL, "The core's versioned timer id.", NULL},
    {"loop", (getter)Handle_get_loop, NULL, "The loop it is delivered to (None: dispatcher).",
     NULL},
    {"callback", (getter)Handle_get_callback, NULL, "The callback (None once finished).", NULL},
    {"args", (getter)Handle_get_args, NULL, "The callback's arguments (None once finished).",
     NULL},
    {NULL}};

static PyMemberDef Handle_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(HandleObject, weakreflist), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot Handle_slots[] = {
    {Py_tp_doc, "A scheduled callback.  Made by TimerThread.call_later / call_at."},
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_clear, Handle_clear},
    {Py_tp_methods, Handle_methods},
    {Py_tp_getset, Handle_getset},
    {Py_tp_members, Handle_members},
    {Py_tp_repr, Handle_repr},
    {0, NULL}};

static PyType_Spec Handle_spec = {
    .name = "bucketimer._core.Handle",
    .basicsize = sizeof(HandleObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Handle_slots,
};

/* ---- Port --------------------------------------------------------------- */

static int Port_traverse(PortObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->tt);
    Py_VISIT(self->loop);
    Py_VISIT(self->on_error);
    return 0;
}

static int Port_clear(PortObject *self) {
    Py_CLEAR(self->loop);
    Py_CLEAR(self->on_error);
    Py_CLEAR(self->tt);
    return 0;
}

static void Port_dealloc(PortObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    /* The bt_port itself lives until the core is destroyed: pending timers
     * may still point at it. */
    Port_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *timeout_fire(PyObject *timeout);

/* Runs (or, in drop mode, releases) one claimed handle.  Returns -1 with an
 * exception set only for exceptions that must propagate (KeyboardInterrupt,
 * SystemExit, or a failing error handler). */
static int run_handle(PortObject *self, HandleObject *h, int drop) {
    PyObject *cb = h->callback, *args = h->args, *ctx = h->context;
    h->callback = h->args = h->context = NULL;
    atomic_store_explicit(&h->state, drop ? H_DROPPED : H_RAN, memory_order_release);
    int result = 0;
    if (!drop && cb) {
        PyObject *res = NULL;
        /* A Timeout's expiry handle has no context (see schedule_resolved). */
        if (!ctx || PyContext_Enter(ctx) == 0) {
            res = h->is_timeout ? timeout_fire(cb) : PyObject_Call(cb, args, NULL);
            if (ctx) {
                PyObject *exc = res ? NULL : PyErr_GetRaisedException();
                PyContext_Exit(ctx);
                if (exc) PyErr_SetRaisedException(exc);
            }
        }
        if (res) {
            Py_DECREF(res);
        } else if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) ||
                   PyErr_ExceptionMatches(PyExc_SystemExit)) {
            result = -1;
        } else {
            PyObject *exc = PyErr_GetRaisedException();
            /* The handle shows its callback while being reported. */
            h->callback = Py_NewRef(cb);
            h->args = Py_NewRef(args);
            if (self->on_error && self->on_error != Py_None) {
                PyObject *r = PyObject_CallFunctionObjArgs(self->on_error, (PyObject *)h, exc,
                                                           NULL);
                if (r) Py_DECREF(r);
                else if (PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) ||
                         PyErr_ExceptionMatches(PyExc_SystemExit))
                    result = -1;
                else PyErr_WriteUnraisable(self->on_error);
            } else {
                PyErr_SetRaisedException(Py_NewRef(exc));
                PyErr_WriteUnraisable(cb);
            }
            Py_DECREF(exc);
            Py_CLEAR(h->callback);
            Py_CLEAR(h->args);
        }
    }
    Py_XDECREF(cb);
    Py_XDECREF(args);
    Py_XDECREF(ctx);
    return result;
}

/* Runs every timer posted to this port.  The eventfd is acked first; a
 * timer cancelled after it was posted is released without running (its
 * cancel() already dropped the slot's reference).  If a callback raises
 * KeyboardInterrupt or SystemExit, the rest stay queued, the port is
 * signalled again, and the exception propagates, as asyncio would let it. */
static PyObject *Port_drain_impl(PortObject *self, int drop_all) {
    if (atomic_exchange(&self->draining, 1)) return PyLong_FromLong(0); /* re-entered */
    int drop = drop_all || self->drop;
    bt_port_ack(self->port);
    long ran = 0;
    bt_timer *t;
    while ((t = bt_port_pop(self->port)) != NULL) {
        HandleObject *h = (HandleObject *)bt_timer_payload(t);
        if (!(drop ? bt_timer_take(self->port, t) : bt_timer_claim(self->port, t))) {
            bt_timer_release(self->port, t);
            continue;
        }
        /* The slot's reference to h is ours now. */
        bt_timer_release(self->port, t);
        int rc = run_handle(self, h, drop);
        Py_DECREF(h);
        ran++;
        if (rc < 0) {
            bt_port_signal(self->port);
            atomic_store(&self->draining, 0);
            return NULL;
        }
    }
    atomic_store(&self->draining, 0);
    return PyLong_FromLong(ran);
}

static PyObject *Port_drain(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    return Port_drain_impl(self, 0);
}

static PyObject *Port_fileno(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(bt_port_fd(self->port));
}

/* Closes the fd and releases whatever is queued without running it.  Timers
 * that come due later go to the core's orphan port. */
static PyObject *Port_detach(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    bt_port_detach(self->port);
    PyObject *r = Port_drain_impl(self, 1);
    if (!r) return NULL;
    Py_DECREF(r);
    TimerThreadObject *tt = self->tt;
    if (tt && tt->cached_port == self) {
        Py_CLEAR(tt->cached_loop);
        Py_CLEAR(tt->cached_port);
    }
    Py_RETURN_NONE;
}

static PyObject *Port_get_loop(PortObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->loop);
}

static PyMethodDef Port_methods[] = {
    {"drain", (PyCFunction)Port_drain, METH_NOARGS,
     "Run every posted timer; returns how many were taken."},
    {"fileno", (PyCFunction)Port_fileno, METH_NOARGS,
     "The eventfd that becomes readable when timers are posted (-1 when detached)."},
    {"detach", (PyCFunction)Port_detach, METH_NOARGS,
     "Close the fd and drop queued timers without running them."},
    {NULL}};

static PyGetSetDef Port_getset[] = {
    {"loop", (getter)Port_get_loop, NULL, "The loop served (None: dispatcher).", NULL},
    {NULL}};

static PyMemberDef Port_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(PortObject, weakreflist), Py_READONLY, NULL},
    {"on_error", Py_T_OBJECT_EX, offsetof(PortObject, on_error), 0,
     "on_error(handle, exc): called when a callback raises."},
    {NULL}};

static PyType_Slot Port_slots[] = {
    {Py_tp_doc, "Where due timers of one loop (or the dispatcher) wait to run."},
    {Py_tp_dealloc, Port_dealloc},
    {Py_tp_traverse, Port_traverse},
    {Py_tp_clear, Port_clear},
    {Py_tp_methods, Port_methods},
    {Py_tp_getset, Port_getset},
    {Py_tp_members, Port_members},
    {0, NULL}};

static PyType_Spec Port_spec = {
    .name = "bucketimer._core.Port",
    .basicsize = sizeof(PortObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Port_slots,
};

static PortObject *port_new(TimerThreadObject *tt, bt_port *p, PyObject *loop, int drop) {
    PortObject *self = PyObject_GC_New(PortObject, tt->state->Port_Type);
    if (!self) return NULL;
    self->port = p;
    self->tt = (TimerThreadObject *)Py_NewRef(tt);
    self->loop = Py_NewRef(loop);
    self->on_error = Py_NewRef(Py_None);
    self->drop = drop;
    atomic_init(&self->draining, 0);
    self->weakreflist = NULL;
    PyObject_GC_Track(self);
    return self;
}

/* ---- TimerThread -------------------------------------------------------- */

static struct PyModuleDef core_module;

static int TimerThread_init(TimerThreadObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buckets", "drain_threshold", NULL};
    unsigned int buckets = 13, drain = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I$I:TimerThread", kwlist, &buckets, &drain))
        return -1;
    if (self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is already initialised");
        return -1;
    }
    if (buckets < 1 || buckets > 256) {
        PyErr_SetString(PyExc_ValueError, "buckets must be between 1 and 256");
        return -1;
    }
    if (drain < 16) {
        PyErr_SetString(PyExc_ValueError, "drain_threshold must be at least 16");
        return -1;
    }
    PyObject *module = PyType_GetModuleByDef(Py_TYPE(self), &core_module);
    if (!module) return -1;
    self->state = get_state(module);
    bt_options opt;
    bt_options_init(&opt);
    opt.num_buckets = buckets;
    opt.drain_threshold = drain;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = bt_create(&opt, &self->core);
    Py_END_ALLOW_THREADS if (rc) {
        raise_errno(rc, "bt_create");
        return -1;
    }
    return 0;
}

static int TimerThread_traverse(TimerThreadObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->cached_loop);
    Py_VISIT(self->cached_port);
    Py_VISIT(self->dispatcher);
    return 0;
}

static int TimerThread_clear(TimerThreadObject *self) {
    Py_CLEAR(self->cached_loop);
    Py_CLEAR(self->cached_port);
    Py_CLEAR(self->dispatcher);
    return 0;
}

static void drop_handle(void *ctx, bt_port *port, void *payload) {
    (void)ctx;
    if (!port || !payload) return;
    HandleObject *h = (HandleObject *)payload;
    atomic_store(&h->state, H_DROPPED);
    handle_release_callback(h);
    Py_DECREF(h);
}

/* Stops the core and drops every pending or posted timer without running
 * it.  Returns how many were dropped. */
static int64_t close_core(TimerThreadObject *self) {
    if (!self->core || self->closed) return 0;
    self->closed = 1;
    Py_BEGIN_ALLOW_THREADS bt_stop(self->core);
    Py_END_ALLOW_THREADS return bt_drop_all(self->core, drop_handle, NULL);
}

static void TimerThread_dealloc(TimerThreadObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    TimerThread_clear(self);
    if (self->core) {
        /* No handle or port refers to us any more (they hold references),
         * so nothing is pending: stopping and freeing is safe. */
        close_core(self);
        Py_BEGIN_ALLOW_THREADS bt_destroy(self->core);
        Py_END_ALLOW_THREADS self->core = NULL;
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int check_open(TimerThreadObject *self) {
    if (!self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is not initialised");
        return -1;
    }
    if (self->closed || bt_is_stopped(self->core)) {
        raise_errno(bt_is_stopped(self->core) && !self->closed ? -ECHILD : -ESHUTDOWN, "");
        return -1;
    }
    return 0;
}

/* Finds the port for `loop` (None: the dispatcher).  New reference: once
 * the GIL is let go (an allocation can run a finalizer), another thread may
 * detach the loop's port and drop every other reference to it. */
static PortObject *port_for(TimerThreadObject *self, PyObject *loop) {
#ifndef Py_GIL_DISABLED
    if (loop == self->cached_loop && self->cached_port && bt_port_fd(self->cached_port->port) >= 0)
        return (PortObject *)Py_NewRef(self->cached_port);
    if (loop == Py_None && self->dispatcher) return (PortObject *)Py_NewRef(self->dispatcher);
#endif
    PyObject *p = PyObject_CallMethodOneArg((PyObject *)self, self->state->str_port_for, loop);
    if (!p) return NULL;
    if (!Py_IS_TYPE(p, self->state->Port_Type) || ((PortObject *)p)->tt != self) {
        Py_DECREF(p);
        PyErr_SetString(PyExc_TypeError, "_port_for must return a Port of this TimerThread");
        return NULL;
    }
#ifndef Py_GIL_DISABLED
    if (loop == Py_None) {
        Py_XSETREF(self->dispatcher, (PortObject *)Py_NewRef(p));
    } else {
        Py_XSETREF(self->cached_loop, Py_NewRef(loop));
        Py_XSETREF(self->cached_port, (PortObject *)Py_NewRef(p));
    }
#endif
    return (PortObject *)p;
}

static PyObject *schedule_resolved(TimerThreadObject *self, int absolute, double t, PyObject *cb,
                                   PyObject *const *cbargs, Py_ssize_t ncbargs, PyObject *loop,
                                   PyObject *context, int flags);
static PyObject *TimerThread_scheduler(TimerThreadObject *self, PyObject *args);

/* The argument shape every call_later/call_at shares: (time, callback,
 * *args) and the keywords context= and, where `loop` is not NULL, loop=. */
static int parse_schedule_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                               int absolute, PyObject **loop, PyObject **context) {
    const char *name = absolute ? "call_at" : "call_later";
    if (nargs < 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes a %s and a callback", name,
                     absolute ? "deadline" : "delay");
        return -1;
    }
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (loop && PyUnicode_CompareWithASCIIString(k, "loop") == 0) *loop = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(k, "context") == 0) *context = args[nargs + i];
        else {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name, k);
            return -1;
        }
    }
    return 0;
}

/* call_later(delay, callback, *args, loop=None, context=None) and call_at. */
static PyObject *schedule(TimerThreadObject *self, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames, int absolute) {
    PyObject *loop = NULL, *context = NULL;
    if (parse_schedule_args(args, nargs, kwnames, absolute, &loop, &context) < 0) return NULL;
    if (check_open(self) < 0) return NULL;
    double t;
    if (to_seconds(args[0], absolute ? "when" : "delay", &t) < 0) return NULL;
    /* Where it will be delivered. */
    PyObject *resolved = NULL;
    if (loop == NULL || loop == Py_None) {
        resolved = running_loop(self->state);
        if (!resolved) return NULL;
    } else {
        resolved = Py_NewRef(loop);
    }
    PyObject *h = schedule_resolved(self, absolute, t, args[1], args + 2, nargs - 2, resolved,
                                    context, 0);
    Py_DECREF(resolved);
    return h;
}

/* The common tail of every way to schedule: `t` is a parsed delay or
 * deadline, `loop` the loop it goes to (None: the dispatcher). */
/* flags for schedule_resolved */
#define SCHED_COMPAT 1  /* asyncio.TimerHandle semantics */
#define SCHED_TIMEOUT 2 /* cb is a Timeout: expire it */

static PyObject *schedule_resolved(TimerThreadObject *self, int absolute, double t, PyObject *cb,
                                   PyObject *const *cbargs, Py_ssize_t ncbargs, PyObject *loop,
                                   PyObject *context, int flags) {
    const char *name = absolute ? "call_at" : "call_later";
    if (!(flags & SCHED_TIMEOUT) && !PyCallable_Check(cb)) {
        PyErr_Format(PyExc_TypeError, "callback must be callable, not %.100s", Py_TYPE(cb)->tp_name);
        return NULL;
    }
    if (context == Py_None) context = NULL;
    if (context && !PyContext_CheckExact(context)) {
        PyErr_Format(PyExc_TypeError, "context must be a contextvars.Context, not %.100s",
                     Py_TYPE(context)->tp_name);
        return NULL;
    }
    PortObject *port = port_for(self, loop);
    if (!port) return NULL;

    int64_t deadline;
    double when;
    if (absolute) {
        when = t;
        deadline = when_to_ns(t);
    } else {
        int64_t now = bt_now_ns();
        when = (double)now / 1e9 + t;
        if (t > 9.2e9) {
            deadline = INT64_MAX; /* never: and when() says so */
            when = INFINITY;
        } else {
            if (t < -9.2e9) t = -9.2e9;
            int64_t d = (int64_t)ceil(t * 1e9);
            /* saturate instead of overflowing int64 (uptime + delay) */
            deadline = d > 0 && d > INT64_MAX - now ? INT64_MAX : now + d;
        }
    }

    HandleObject *h = handle_alloc(self->state->Handle_Type);
    if (!h) {
        Py_DECREF(port);
        return NULL;
    }
    h->tt = (TimerThreadObject *)Py_NewRef(self);
    h->port = port; /* port_for's reference */
    h->when = when;
    h->callback = Py_NewRef(cb);
    h->args = tuple_from_array(cbargs, ncbargs);
    h->compat = (flags & SCHED_COMPAT) != 0;
    h->cancel_called = 0;
    h->is_timeout = (flags & SCHED_TIMEOUT) != 0;
    /* A Timeout's expiry only calls task.cancel(): it needs no copy of the
     * context (asyncio's handle would run it in one; nothing reads it). */
    h->context = context ? Py_NewRef(context)
                 : (flags & SCHED_TIMEOUT) ? NULL : PyContext_CopyCurrent();
    atomic_init(&h->state, H_PENDING);
    h->weakreflist = NULL;
    h->id = 0;
    PyObject_GC_Track(h);
    if (!h->args || (!h->context && !(flags & SCHED_TIMEOUT))) {
        Py_DECREF(h);
        return NULL;
    }
    /* The slot's reference, handed over at schedule. */
    Py_INCREF(h);
    int rc = bt_schedule_port(self->core, deadline, port->port, h, &h->id);
    if (rc) {
        Py_DECREF(h); /* the slot's */
        atomic_store(&h->state, H_DROPPED);
        Py_DECREF(h);
        return raise_errno(rc, name);
    }
    return (PyObject *)h;
}

static PyObject *TimerThread_call_later(TimerThreadObject *self, PyObject *const *args,
                                        Py_ssize_t nargs, PyObject *kwnames) {
    return schedule(self, args, PyVectorcall_NARGS(nargs), kwnames, 0);
}

static PyObject *TimerThread_call_at(TimerThreadObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
    return schedule(self, args, PyVectorcall_NARGS(nargs), kwnames, 1);
}

static PyObject *TimerThread_open_port(TimerThreadObject *self, PyObject *loop) {
    if (check_open(self) < 0) return NULL;
    bt_port *p;
    int rc = bt_port_open(self->core, 1, &p);
    if (rc) return raise_errno(rc, "bt_port_open");
    return (PyObject *)port_new(self, p, loop, 0);
}

static PyObject *TimerThread_orphans(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) return raise_errno(-EINVAL, "orphans");
    return (PyObject *)port_new(self, bt_orphans(self->core), Py_None, 1);
}

static PyObject *TimerThread_close_core(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) Py_RETURN_NONE;
    int64_t n = close_core(self);
    Py_CLEAR(self->cached_loop);
    Py_CLEAR(self->cached_port);
    return PyLong_FromLongLong(n);
}

static PyObject *TimerThread_get_closed(TimerThreadObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(!self->core || self->closed || bt_is_stopped(self->core));
}

static PyObject *TimerThread_time(TimerThreadObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    return PyFloat_FromDouble((double)bt_now_ns() / 1e9);
}

static PyObject *TimerThread_stats(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) return PyDict_New();
    bt_stats s;
    Py_BEGIN_ALLOW_THREADS bt_get_stats(self->core, &s);
    Py_END_ALLOW_THREADS PyObject *hist = PyList_New(48);
    if (!hist) return NULL;
    for (int i = 0; i < 48; i++) PyList_SET_ITEM(hist, i, PyLong_FromUnsignedLongLong(s.lateness_hist[i]));
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsNsIsKsK}", "scheduled", s.scheduled, "cancelled",
        s.cancelled, "fired", s.fired, "posted", s.posted, "ran", s.ran, "wakeups", s.wakeups,
        "passes", s.passes, "eventfd_writes", s.eventfd_writes, "drains", s.drains, "sweeps",
        s.sweeps, "reaped", s.reaped, "heap_size", s.heap_size, "list_size", s.list_size, "dead",
        s.dead, "slots", s.slots, "slots_free", s.slots_free, "ports", s.ports, "early_fires",
        s.early_fires, "lateness_hist", hist, "buckets", (unsigned int)0, "slots_retired",
        s.slots_retired, "dropped", s.dropped);
}

static PyMethodDef TimerThread_methods[] = {
    {"call_later", (PyCFunction)(void (*)(void))TimerThread_call_later,
     METH_FASTCALL | METH_KEYWORDS,
     "call_later(delay, callback, *args, loop=None, context=None) -> Handle\n\n"
     "Run callback(*args) after delay seconds.  Inside a running event loop (or with loop=) it "
     "runs in that loop's thread; otherwise on this TimerThread's dispatcher thread."},
    {"call_at", (PyCFunction)(void (*)(void))TimerThread_call_at, METH_FASTCALL | METH_KEYWORDS,
     "call_at(when, callback, *args, loop=None, context=None) -> Handle\n\n"
     "Like call_later, at time.monotonic() == when."},
    {"stats", (PyCFunction)TimerThread_stats, METH_NOARGS, "The core's counters, as a dict."},
    {"time", (PyCFunction)TimerThread_time, METH_NOARGS, "The core's clock: time.monotonic()."},
    {"_open_port", (PyCFunction)TimerThread_open_port, METH_O, NULL},
    {"_orphans", (PyCFunction)TimerThread_orphans, METH_NOARGS, NULL},
    {"_close_core", (PyCFunction)TimerThread_close_core, METH_NOARGS, NULL},
    {"_scheduler", (PyCFunction)TimerThread_scheduler, METH_VARARGS, NULL},
    {NULL}};

static PyGetSetDef TimerThread_getset[] = {
    {"closed", (getter)TimerThread_get_closed, NULL, "True once close() was called.", NULL},
    {NULL}};

static PyMemberDef TimerThread_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(TimerThreadObject, weakreflist), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot TimerThread_slots[] = {
    {Py_tp_doc, "The native part of bucketimer.TimerThread."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, TimerThread_init},
    {Py_tp_dealloc, TimerThread_dealloc},
    {Py_tp_traverse, TimerThread_traverse},
    {Py_tp_clear, TimerThread_clear},
    {Py_tp_methods, TimerThread_methods},
    {Py_tp_getset, TimerThread_getset},
    {Py_tp_members, TimerThread_members},
    {0, NULL}};

static PyType_Spec TimerThread_spec = {
    .name = "bucketimer._core.TimerThread",
    .basicsize = sizeof(TimerThreadObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = TimerThread_slots,
};

/* ---- Scheduler: loop.call_at / loop.call_later of the drop-in loop --------
 * A callable bound to (TimerThread, loop) so the drop-in loop's call_later
 * is one vectorcall, with asyncio.TimerHandle semantics on its handles. */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TimerThreadObject *tt;
    PyObject *loop;
    int absolute;
} SchedulerObject;

static PyObject *Scheduler_vectorcall(SchedulerObject *self, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *context = NULL;
    if (parse_schedule_args(args, nargs, kwnames, self->absolute, NULL, &context) < 0)
        return NULL;
    if (check_open(self->tt) < 0) return NULL;
    double t;
    if (to_seconds(args[0], self->absolute ? "when" : "delay", &t) < 0) return NULL;
    return schedule_resolved(self->tt, self->absolute, t, args[1], args + 2, nargs - 2, self->loop,
                             context, SCHED_COMPAT);
}

static int Scheduler_traverse(SchedulerObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->tt);
    Py_VISIT(self->loop);
    return 0;
}

static int Scheduler_clear(SchedulerObject *self) {
    Py_CLEAR(self->tt);
    Py_CLEAR(self->loop);
    return 0;
}

static void Scheduler_dealloc(SchedulerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Scheduler_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef Scheduler_members[] = {
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(SchedulerObject, vectorcall), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot Scheduler_slots[] = {
    {Py_tp_doc, "loop.call_at / loop.call_later of the drop-in loop (asyncio handle semantics)."},
    {Py_tp_dealloc, Scheduler_dealloc},
    {Py_tp_traverse, Scheduler_traverse},
    {Py_tp_clear, Scheduler_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, Scheduler_members},
    {0, NULL}};

static PyType_Spec Scheduler_spec = {
    .name = "bucketimer._core.Scheduler",
    .basicsize = sizeof(SchedulerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = Scheduler_slots,
};

/* TimerThread._scheduler(loop, absolute) */
static PyObject *TimerThread_scheduler(TimerThreadObject *self, PyObject *args) {
    PyObject *loop;
    int absolute;
    if (!PyArg_ParseTuple(args, "Op:_scheduler", &loop, &absolute)) return NULL;
    if (!self->state) return raise_errno(-EINVAL, "_scheduler");
    SchedulerObject *o = PyObject_GC_New(SchedulerObject, self->state->Scheduler_Type);
    if (!o) return NULL;
    o->vectorcall = (vectorcallfunc)Scheduler_vectorcall;
    o->tt = (TimerThreadObject *)Py_NewRef(self);
    o->loop = Py_NewRef(loop);
    o->absolute = absolute;
    PyObject_GC_Track(o);
    return (PyObject *)o;
}

/* ---- Ready: an awaitable that is already done ----------------------------
 * What Timeout.__aenter__/__aexit__ return: awaiting it never suspends. */

typedef struct {
    PyObject_HEAD
    core_state *st;
    PyObject *value;
} ReadyObject;

static PyObject *ready_new(core_state *st, PyObject *value) {
    if (value == Py_None && st->ready_none) return Py_NewRef(st->ready_none);
    ReadyObject *r;
#ifndef Py_GIL_DISABLED
    if (st->ready_spare) {
        r = (ReadyObject *)st->ready_spare;
        st->ready_spare = NULL;
        (void)PyObject_Init((PyObject *)r, st->Ready_Type);
    } else
#endif
    {
        r = PyObject_New(ReadyObject, st->Ready_Type);
        if (!r) return NULL;
    }
    r->st = st;
    r->value = Py_NewRef(value);
    return (PyObject *)r;
}

static void Ready_dealloc(ReadyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    Py_CLEAR(self->value);
#ifndef Py_GIL_DISABLED
    /* One spare: __aenter__ makes one, the await drops it at once. */
    if (!self->st->ready_spare && self->st->Ready_Type == tp &&
        self != (ReadyObject *)self->st->ready_none) {
        self->st->ready_spare = (PyObject *)self;
        Py_DECREF(tp);
        return;
    }
#endif
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *Ready_await(ReadyObject *self) { return Py_NewRef(self); }

/* Raises StopIteration(value) the way `return value` ends a coroutine.
 *
 * From 3.12 the interpreter's SEND no longer uses am_send for objects other
 * than generators and coroutines: it calls tp_iternext and fetches the
 * value out of the StopIteration.  Making that exception (its args tuple,
 * __init__, the context bookkeeping of PyErr_SetObject) was a sixth of an
 * `async with timeout()`.  So one instance is kept and raised again as long
 * as nobody else holds it or its args and it has picked up no traceback,
 * context, cause or notes: SEND reads `value` and drops its reference at
 * once, so in the common case it is ours alone again before the next raise.
 * Its args tuple, ours alone too, is refilled in place, so that whoever
 * catches it sees what StopIteration(value) would show.  Whoever keeps it
 * (a debugger, sys.monitoring, an `except StopIteration as e`) keeps it
 * unchanged: we make a new one. */
static PyObject *raise_stop_iteration(core_state *st, PyObject *value) {
#ifndef Py_GIL_DISABLED
    PyObject *e = st->stop_iteration;
    if (e) {
        PyBaseExceptionObject *b = (PyBaseExceptionObject *)e;
        if (Py_REFCNT(e) == 1 && !b->traceback && !b->context && !b->cause && !b->notes &&
            !b->suppress_context && b->args && PyTuple_CheckExact(b->args) &&
            Py_REFCNT(b->args) == 1 && PyTuple_GET_SIZE(b->args) == 1 &&
            Py_IS_TYPE(e, (PyTypeObject *)PyExc_StopIteration)) {
            PyObject *old = PyTuple_GET_ITEM(b->args, 0);
            PyTuple_SET_ITEM(b->args, 0, Py_NewRef(value));
            Py_DECREF(old);
            Py_XSETREF(((PyStopIterationObject *)e)->value, Py_NewRef(value));
            PyErr_SetRaisedException(Py_NewRef(e));
            return NULL;
        }
        Py_CLEAR(st->stop_iteration);
    }
    e = PyObject_CallOneArg(PyExc_StopIteration, value);
    if (!e) return NULL;
    st->stop_iteration = Py_NewRef(e);
    PyErr_SetRaisedException(e);
    return NULL;
#else
    PyObject *e = PyObject_CallOneArg(PyExc_StopIteration, value);
    if (!e) return NULL;
    PyErr_SetRaisedException(e);
    return NULL;
#endif
}

/* Drops the kept StopIteration's references to `value` if it still has
 * them and nobody else holds it (so that a Timeout is not kept alive by
 * it). */
static void forget_stop_iteration(core_state *st, PyObject *value) {
#ifndef Py_GIL_DISABLED
    PyObject *e = st->stop_iteration;
    if (e && Py_REFCNT(e) == 1 && ((PyStopIterationObject *)e)->value == value) {
        PyObject *args = ((PyBaseExceptionObject *)e)->args;
        if (args && PyTuple_CheckExact(args) && Py_REFCNT(args) == 1 &&
            PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == value) {
            PyTuple_SET_ITEM(args, 0, Py_NewRef(Py_None));
            Py_DECREF(value);
            Py_SETREF(((PyStopIterationObject *)e)->value, Py_NewRef(Py_None));
        } else {
            Py_CLEAR(st->stop_iteration);
        }
    }
#else
    (void)st;
    (void)value;
#endif
}

static PyObject *Ready_iternext(ReadyObject *self) {
    if (self->value == Py_None) return NULL; /* exhausted: the result is None */
    return raise_stop_iteration(self->st, self->value);
}

/* The exception a coroutine's throw(exc) or throw(type[, value[, tb]]) is
 * asked to raise, checked as generators check it; NULL with an error set. */
static PyObject *throw_args_exception(PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "throw expected at least 1 argument, got %zd", nargs);
        return NULL;
    }
    PyObject *typ = args[0], *val = nargs > 1 ? args[1] : Py_None;
    PyObject *tb = nargs > 2 ? args[2] : Py_None;
    if (tb != Py_None && !PyTraceBack_Check(tb)) {
        PyErr_SetString(PyExc_TypeError, "throw() third argument must be a traceback object");
        return NULL;
    }
    if (PyExceptionInstance_Check(typ)) {
        if (val != Py_None) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return NULL;
        }
        PyErr_SetRaisedException(Py_NewRef(typ));
    } else if (PyExceptionClass_Check(typ)) {
        PyErr_SetObject(typ, val);
    } else {
        PyErr_Format(PyExc_TypeError,
                     "exceptions must be classes or instances deriving from BaseException, "
                     "not %s",
                     Py_TYPE(typ)->tp_name);
        return NULL;
    }
    PyObject *exc = PyErr_GetRaisedException();
    if (exc && tb != Py_None && PyException_SetTraceback(exc, tb) < 0) Py_CLEAR(exc);
    return exc;
}

/* send(), throw() and close(), for code that drives an awaitable by hand
 * (as it would a coroutine): send() finishes it, throw() raises into the
 * caller, close() does nothing. */
static PyObject *Ready_send_method(ReadyObject *self, PyObject *Py_UNUSED(arg)) {
    if (self->value == Py_None) {
        PyErr_SetNone(PyExc_StopIteration);
        return NULL;
    }
    return raise_stop_iteration(self->st, self->value);
}

static PyObject *Ready_throw(ReadyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    PyObject *exc = throw_args_exception(args, nargs);
    if (exc) PyErr_SetRaisedException(exc);
    return NULL;
}

static PyObject *Ready_close(ReadyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    Py_RETURN_NONE;
}

static PyMethodDef Ready_methods[] = {
    {"send", (PyCFunction)Ready_send_method, METH_O, NULL},
    {"throw", (PyCFunction)(void (*)(void))Ready_throw, METH_FASTCALL, NULL},
    {"close", (PyCFunction)Ready_close, METH_NOARGS, NULL},
    {NULL}};

static PySendResult Ready_send(ReadyObject *self, PyObject *arg, PyObject **result) {
    (void)arg;
    *result = Py_NewRef(self->value);
    return PYGEN_RETURN;
}

static PyType_Slot Ready_slots[] = {
    {Py_tp_dealloc, Ready_dealloc},
    {Py_am_await, Ready_await},
    {Py_am_send, Ready_send},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, Ready_iternext},
    {Py_tp_methods, Ready_methods},
    {0, NULL}};

static PyType_Spec Ready_spec = {
    .name = "bucketimer._core._Ready",
    .basicsize = sizeof(ReadyObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Ready_slots,
};

/* ---- Timeout: asyncio.Timeout with its timer in the core -----------------
 * The same state machine as asyncio.timeouts.Timeout of the running Python
 * (3.11 and 3.12 share it; 3.13 also converts a CancelledError subclass and
 * inserts a TimeoutError into the chain of other exceptions), written in C
 * so that `async with timeout(d): ...` costs a few C calls: __aenter__ and
 * __aexit__ return awaitables that are already done. */

enum { T_CREATED, T_ENTERED, T_EXPIRING, T_EXPIRED, T_EXITED };
static const char *const timeout_state_names[] = {"created", "active", "expiring", "expired",
                                                   "finished"};

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

static int Timeout_traverse(TimeoutObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->when);
    Py_VISIT(self->handler);
    Py_VISIT(self->task);
    Py_VISIT(self->on_timeout);
    return 0;
}

static int Timeout_clear(TimeoutObject *self) {
    Py_CLEAR(self->when);
    Py_CLEAR(self->handler);
    Py_CLEAR(self->task);
    Py_CLEAR(self->on_timeout);
    return 0;
}

static void Timeout_dealloc(TimeoutObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    Timeout_clear(self);
#ifndef Py_GIL_DISABLED
    /* A few dead Timeouts are kept for the next timeout(): each `async with`
     * makes and drops one.  Only for the module's own type, while it lives. */
    core_state *st = self->st;
    if (st->timeout_nfree < TIMEOUT_FREELIST_MAX && st->Timeout_Type == tp) {
        st->timeout_free[st->timeout_nfree++] = self;
        Py_DECREF(tp); /* PyObject_Init takes it again on reuse */
        return;
    }
#endif
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *timeout_make(core_state *st, PyObject *when) {
    TimeoutObject *self;
#ifndef Py_GIL_DISABLED
    if (st->timeout_nfree > 0) {
        self = st->timeout_free[--st->timeout_nfree];
        (void)PyObject_Init((PyObject *)self, st->Timeout_Type);
    } else
#endif
    {
        self = PyObject_GC_New(TimeoutObject, st->Timeout_Type);
    }
    if (!self) return NULL;
    self->st = st;
    self->state = T_CREATED;
    self->cancelling = 0;
    self->when = Py_NewRef(when);
    self->handler = self->task = self->on_timeout = NULL;
    self->weakreflist = NULL;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyObject *Timeout_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"when", NULL};
    PyObject *when;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Timeout", kwlist, &when)) return NULL;
    PyObject *m = PyType_GetModuleByDef(type, &core_module);
    if (!m) return NULL;
    return timeout_make(get_state(m), when);
}

/* The TimerThread timeouts arm on: the process default, refreshed when it
 * was closed or belongs to a parent process.  Borrowed. */
static TimerThreadObject *default_tt(core_state *st) {
    TimerThreadObject *tt = (TimerThreadObject *)st->default_tt;
    if (tt && tt->core && !tt->closed && !bt_is_stopped(tt->core)) return tt;
    if (!st->default_factory) {
        PyErr_SetString(PyExc_RuntimeError, "bucketimer is not initialised");
        return NULL;
    }
    PyObject *n = PyObject_CallNoArgs(st->default_factory);
    if (!n) return NULL;
    if (!PyObject_TypeCheck(n, st->TimerThread_Type)) {
        Py_DECREF(n);
        PyErr_SetString(PyExc_TypeError, "default_timer_thread() must return a TimerThread");
        return NULL;
    }
    Py_XSETREF(st->default_tt, n);
    return (TimerThreadObject *)n;
}

/* loop.time().  For a loop class that keeps asyncio's BaseEventLoop.time
 * (time.monotonic(), the core's clock) it is read directly: on 3.12 the
 * Python-level call is a quarter of an `async with timeout()`.  The answer
 * is cached for the last loop class seen; patching `time` on a loop class
 * after it was first used here is not noticed. */
static int loop_time_is_stock(core_state *st, PyObject *loop) {
    PyTypeObject *tp = Py_TYPE(loop);
    if (tp != st->time_checked_type) {
        PyObject *f = PyObject_GetAttr((PyObject *)tp, st->str_time);
        if (!f) return -1;
        st->time_checked_is_stock = (f == st->stock_time);
        st->time_checked_type = tp;
        Py_DECREF(f);
    }
    return st->time_checked_is_stock;
}

static PyObject *loop_time(core_state *st, PyObject *loop) {
    int stock = loop_time_is_stock(st, loop);
    if (stock < 0) return NULL;
    /* time.monotonic() computes the same double from the same ns */
    if (stock) return PyFloat_FromDouble((double)bt_now_ns() / 1e9);
    return PyObject_CallMethodNoArgs(loop, st->str_time);
}

/* `when <= loop.time()`, as asyncio's Timeout.reschedule() asks it.
 * `now_ns`, if not negative, is the stock clock read a moment ago by the
 * same caller (no code ran in between). */
static int deadline_reached(core_state *st, PyObject *loop, PyObject *when, int64_t now_ns) {
    if (PyFloat_CheckExact(when)) {
        int stock = loop_time_is_stock(st, loop);
        if (stock < 0) return -1;
        if (stock)
            return PyFloat_AS_DOUBLE(when) <= (double)(now_ns >= 0 ? now_ns : bt_now_ns()) / 1e9;
    }
    PyObject *now = loop_time(st, loop);
    if (!now) return -1;
    int past = PyObject_RichCompareBool(when, now, Py_LE);
    Py_DECREF(now);
    return past;
}

static int cancel_any_handle(core_state *st, PyObject *h) {
    if (Py_IS_TYPE(h, st->Handle_Type)) {
        handle_cancel((HandleObject *)h);
        return 0;
    }
    PyObject *r = PyObject_CallMethodNoArgs(h, st->str_cancel);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *Timeout_on_timeout(TimeoutObject *self, PyObject *Py_UNUSED(ignored));
static PyMethodDef on_timeout_def = {"_on_timeout", (PyCFunction)Timeout_on_timeout, METH_NOARGS,
                                     NULL};

/* reschedule() once the state and loop are checked. */
static int timeout_arm(TimeoutObject *self, PyObject *loop, PyObject *when, int64_t now_ns) {
    core_state *st = self->st;
    Py_XSETREF(self->when, Py_NewRef(when));
    if (self->handler) {
        PyObject *h = self->handler;
        self->handler = NULL;
        int rc = cancel_any_handle(st, h);
        Py_DECREF(h);
        if (rc < 0) return -1;
    }
    if (when == Py_None) return 0;
    int past = deadline_reached(st, loop, when, now_ns);
    if (past < 0) return -1;
    PyObject *h;
    if (past) {
        /* asyncio hands a deadline already reached to call_soon: it fires
         * on the very next iteration, in order with other ready callbacks */
        if (!self->on_timeout) {
            self->on_timeout = PyCFunction_New(&on_timeout_def, (PyObject *)self);
            if (!self->on_timeout) return -1;
        }
        h = PyObject_CallMethodOneArg(loop, st->str_call_soon, self->on_timeout);
    } else {
        double t;
        if (to_seconds(when, "when", &t) < 0) return -1;
        TimerThreadObject *tt = default_tt(st);
        if (!tt || check_open(tt) < 0) return -1;
        /* the handle expires this Timeout directly: no bound method */
        h = schedule_resolved(tt, 1, t, (PyObject *)self, NULL, 0, loop, NULL, SCHED_TIMEOUT);
    }
    if (!h) return -1;
    self->handler = h;
    return 0;
}

static PyObject *need_running_loop(core_state *st) {
    PyObject *loop = running_loop(st);
    if (loop == Py_None) {
        Py_DECREF(loop);
        PyErr_SetString(PyExc_RuntimeError, "no running event loop");
        return NULL;
    }
    return loop;
}

static PyObject *Timeout_reschedule(TimeoutObject *self, PyObject *when) {
    if (self->state != T_ENTERED) {
        if (self->state == T_CREATED) PyErr_SetString(PyExc_RuntimeError, "Timeout has not been entered");
        else PyErr_Format(PyExc_RuntimeError, "Cannot change state of %s Timeout",
                          timeout_state_names[self->state]);
        return NULL;
    }
    PyObject *loop = NULL;
    if (when != Py_None || self->handler) {
        loop = need_running_loop(self->st);
        if (!loop) return NULL;
    }
    int rc = 0;
    if (loop) {
        rc = timeout_arm(self, loop, when, -1);
        Py_DECREF(loop);
    } else {
        Py_XSETREF(self->when, Py_NewRef(when));
    }
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* task.cancelling().  For asyncio's own Task type the method is called
 * through its descriptor, which skips looking in the task's __dict__. */
static PyObject *task_cancelling(core_state *st, PyObject *task) {
    if (Py_TYPE(task) == st->task_type && st->task_cancelling)
        return PyObject_Vectorcall(st->task_cancelling, &task, 1, NULL);
    return PyObject_CallMethodNoArgs(task, st->str_cancelling);
}

/* __aenter__ of a Timeout not yet entered, on the running `loop`; `now_ns`
 * as for deadline_reached(). */
static int timeout_enter(TimeoutObject *self, PyObject *loop, int64_t now_ns) {
    core_state *st = self->st;
    PyObject *task;
    if (st->current_tasks) {
        task = PyDict_GetItemWithError(st->current_tasks, loop);
        if (!task && PyErr_Occurred()) return -1;
        Py_XINCREF(task);
    } else {
        task = PyObject_CallOneArg(st->current_task, loop);
        if (!task) return -1;
    }
    if (!task || task == Py_None) {
        Py_XDECREF(task);
        PyErr_SetString(PyExc_RuntimeError, "Timeout should be used inside a task");
        return -1;
    }
    self->state = T_ENTERED;
    Py_XSETREF(self->task, task);
    PyObject *c = task_cancelling(st, task);
    if (!c) return -1;
    self->cancelling = PyLong_AsLong(c);
    Py_DECREF(c);
    if (self->cancelling == -1 && PyErr_Occurred()) return -1;
    return timeout_arm(self, loop, self->when, now_ns);
}

static PyObject *Timeout_aenter(TimeoutObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->state != T_CREATED) {
        PyErr_SetString(PyExc_RuntimeError, "Timeout has already been entered");
        return NULL;
    }
    PyObject *loop = need_running_loop(self->st);
    if (!loop) return NULL;
    int rc = timeout_enter(self, loop, -1);
    Py_DECREF(loop);
    if (rc < 0) return NULL;
    return ready_new(self->st, (PyObject *)self);
}

/* raise TimeoutError from exc */
static void raise_timeout_from(PyObject *exc) {
    PyObject *te = PyObject_CallNoArgs(PyExc_TimeoutError);
    if (!te) return;
    if (exc && exc != Py_None) {
        PyException_SetCause(te, Py_NewRef(exc));
        PyException_SetContext(te, Py_NewRef(exc));
    }
    PyErr_SetObject(PyExc_TimeoutError, te);
    Py_DECREF(te);
}

static PyObject *Timeout_aexit(TimeoutObject *self, PyObject *const *args, Py_ssize_t nargs) {
    core_state *st = self->st;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__aexit__ takes exc_type, exc_val, exc_tb");
        return NULL;
    }
    PyObject *exc_type = args[0], *exc_val = args[1];
    if (self->state != T_ENTERED && self->state != T_EXPIRING) {
        PyErr_Format(PyExc_AssertionError, "__aexit__ of a %s Timeout",
                     timeout_state_names[self->state]);
        return NULL;
    }
    forget_stop_iteration(st, (PyObject *)self);
    if (self->handler) {
        PyObject *h = self->handler;
        self->handler = NULL;
        int rc = cancel_any_handle(st, h);
        Py_DECREF(h);
        if (rc < 0) return NULL;
    }
    if (self->state == T_EXPIRING) {
        self->state = T_EXPIRED;
        PyObject *n = PyObject_CallMethodNoArgs(self->task, st->str_uncancel);
        if (!n) return NULL;
        long left = PyLong_AsLong(n);
        Py_DECREF(n);
        if (left == -1 && PyErr_Occurred()) return NULL;
        if (left <= self->cancelling && exc_type != Py_None) {
            if (st->insert_timeout_error) { /* 3.13 */
                int sub = PyObject_IsSubclass(exc_type, st->CancelledError);
                if (sub < 0) return NULL;
                if (sub) {
                    raise_timeout_from(exc_val);
                    return NULL;
                }
                if (exc_val != Py_None) {
                    PyObject *r = PyObject_CallOneArg(st->insert_timeout_error, exc_val);
                    if (!r) return NULL;
                    Py_DECREF(r);
                    int eg = PyObject_IsInstance(exc_val, st->ExceptionGroup);
                    if (eg < 0) return NULL;
                    if (eg) {
                        PyObject *excs = PyObject_GetAttrString(exc_val, "exceptions");
                        if (!excs) return NULL;
                        PyObject *it = PyObject_GetIter(excs);
                        Py_DECREF(excs);
                        if (!it) return NULL;
                        PyObject *e;
                        while ((e = PyIter_Next(it))) {
                            r = PyObject_CallOneArg(st->insert_timeout_error, e);
                            Py_DECREF(e);
                            if (!r) break;
                            Py_DECREF(r);
                        }
                        Py_DECREF(it);
                        if (PyErr_Occurred()) return NULL;
                    }
                }
            } else if (exc_type == st->CancelledError) { /* 3.11, 3.12 */
                raise_timeout_from(exc_val);
                return NULL;
            }
        }
    } else {
        self->state = T_EXITED;
    }
    return ready_new(st, Py_None);
}

static PyObject *Timeout_on_timeout(TimeoutObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->state != T_ENTERED || !self->task) Py_RETURN_NONE; /* cannot happen: cancel won */
    PyObject *r = PyObject_CallMethodNoArgs(self->task, self->st->str_cancel);
    if (!r) return NULL;
    Py_DECREF(r);
    self->state = T_EXPIRING;
    Py_CLEAR(self->handler); /* drop the reference early, as asyncio does */
    Py_RETURN_NONE;
}

static PyObject *timeout_fire(PyObject *timeout) {
    return Timeout_on_timeout((TimeoutObject *)timeout, NULL);
}

static PyObject *Timeout_when(TimeoutObject *self, PyObject *Py_UNUSED(ignored)) {
    return Py_NewRef(self->when);
}

static PyObject *Timeout_expired(TimeoutObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(self->state == T_EXPIRING || self->state == T_EXPIRED);
}

static PyObject *Timeout_repr(TimeoutObject *self) {
    if (self->state == T_ENTERED) {
        PyObject *w = self->when == Py_None
                          ? Py_NewRef(Py_None)
                          : PyObject_CallMethod(self->when, "__round__", "i", 3);
        if (!w) return NULL;
        PyObject *r = PyUnicode_FromFormat("<Timeout [active] when=%R>", w);
        Py_DECREF(w);
        return r;
    }
    return PyUnicode_FromFormat("<Timeout [%s]>", timeout_state_names[self->state]);
}

static PyMethodDef Timeout_methods[] = {
    {"__aenter__", (PyCFunction)Timeout_aenter, METH_NOARGS, NULL},
    {"__aexit__", (PyCFunction)(void (*)(void))Timeout_aexit, METH_FASTCALL, NULL},
    {"when", (PyCFunction)Timeout_when, METH_NOARGS, "Return the current deadline."},
    {"reschedule", (PyCFunction)Timeout_reschedule, METH_O,
     "Reschedule the timeout (None: never)."},
    {"expired", (PyCFunction)Timeout_expired, METH_NOARGS,
     "Is timeout expired during execution?"},
    {NULL}};

static PyMemberDef Timeout_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(TimeoutObject, weakreflist), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot Timeout_slots[] = {
    {Py_tp_doc,
     "Timeout(when)\n\nAsynchronous context manager for cancelling overdue code: "
     "asyncio.Timeout with its timer in bucketimer's core.  Use timeout() or timeout_at()."},
    {Py_tp_new, Timeout_new},
    {Py_tp_dealloc, Timeout_dealloc},
    {Py_tp_traverse, Timeout_traverse},
    {Py_tp_clear, Timeout_clear},
    {Py_tp_methods, Timeout_methods},
    {Py_tp_members, Timeout_members},
    {Py_tp_repr, Timeout_repr},
    {0, NULL}};

static PyType_Spec Timeout_spec = {
    .name = "bucketimer.Timeout",
    .basicsize = sizeof(TimeoutObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Timeout_slots,
};

/* timeout(delay) on the running `loop`: a Timeout due at loop.time() +
 * delay.  *now_ns gets the stock clock's reading if that is what was read,
 * else -1. */
static PyObject *timeout_on_loop(core_state *st, PyObject *loop, PyObject *delay, int64_t *now_ns) {
    PyObject *when = NULL;
    int stock;
    *now_ns = -1;
    if (delay == Py_None) {
        when = Py_NewRef(Py_None);
    } else if ((stock = loop_time_is_stock(st, loop)) < 0) {
        /* error set */
    } else if (stock && (PyFloat_CheckExact(delay) || PyLong_CheckExact(delay))) {
        /* the float addition `loop.time() + delay` does, without making
         * loop.time()'s float (an int too large for a double raises the
         * same OverflowError there) */
        double d = PyFloat_CheckExact(delay) ? PyFloat_AS_DOUBLE(delay) : PyLong_AsDouble(delay);
        if (!(d == -1.0 && PyErr_Occurred())) {
            *now_ns = bt_now_ns();
            when = PyFloat_FromDouble((double)*now_ns / 1e9 + d);
        }
    } else {
        PyObject *now = loop_time(st, loop);
        if (now) {
            when = PyNumber_Add(now, delay);
            Py_DECREF(now);
        }
    }
    if (!when) return NULL;
    PyObject *t = timeout_make(st, when);
    Py_DECREF(when);
    return t;
}

static PyObject *core_timeout(PyObject *m, PyObject *delay) {
    core_state *st = get_state(m);
    PyObject *loop = need_running_loop(st);
    if (!loop) return NULL;
    int64_t now_ns;
    PyObject *t = timeout_on_loop(st, loop, delay, &now_ns);
    Py_DECREF(loop);
    return t;
}

static PyObject *core_timeout_at(PyObject *m, PyObject *when) {
    return timeout_make(get_state(m), when);
}

/* ---- wait_for: asyncio.wait_for of 3.12 and later, in C -----------------
 *
 * 3.12 rewrote wait_for() as
 *
 *     async def wait_for(fut, timeout):
 *         if timeout is not None and timeout <= 0:
 *             ...                    # run to completion or cancel, see aio.py
 *         async with timeouts.timeout(timeout):
 *             return await fut
 *
 * WaitFor is that coroutine written out by hand, so that a wait_for() whose
 * awaitable finishes without suspending costs no Python frame, no
 * `async with` and no Ready awaitables: it enters a Timeout, drives the
 * awaited iterator with send()/throw(), and exits the Timeout with whatever
 * that iterator ended with.  It is a coroutine as asyncio sees one
 * (collections.abc.Coroutine: __await__, send, throw, close), so
 * create_task(), gather() and TaskGroup take it, and it follows the
 * generator protocol's rules: re-use after the end, throw() before the
 * start, close() while suspended, finalisation while suspended (which, like
 * a coroutine's close(), exits the Timeout and so cancels its timer).
 *
 * The `timeout <= 0` branch runs aio.py's coroutine for it: it involves a
 * Task and is not a fast path in asyncio either. */

#if PY_VERSION_HEX >= 0x030C0000

enum { W_CREATED, W_SUSPENDED, W_CLOSED };

typedef struct {
    PyObject_HEAD
    core_state *st;
    int state;
    int running;       /* inside send/throw/close */
    PyObject *fut;     /* what to await, until started */
    PyObject *delay;   /* the timeout argument, until started */
    PyObject *inner;   /* the iterator being awaited, while suspended */
    PyObject *timeout; /* the entered Timeout, while suspended; NULL for timeout <= 0 */
} WaitForObject;

static int WaitFor_traverse(WaitForObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->fut);
    Py_VISIT(self->delay);
    Py_VISIT(self->inner);
    Py_VISIT(self->timeout);
    return 0;
}

static int WaitFor_clear(WaitForObject *self) {
    Py_CLEAR(self->fut);
    Py_CLEAR(self->delay);
    Py_CLEAR(self->inner);
    Py_CLEAR(self->timeout);
    return 0;
}

static void WaitFor_dealloc(WaitForObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0) return; /* resurrected */
    PyObject_GC_UnTrack(self);
    WaitFor_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* What `await o` iterates: the interpreter's GET_AWAITABLE. */
static PyObject *awaitable_iter(core_state *st, PyObject *o) {
    if (PyCoro_CheckExact(o) ||
        (PyGen_CheckExact(o) && (PyGen_GetCode((PyGenObject *)o)->co_flags & CO_ITERABLE_COROUTINE))) {
        if (PyCoro_CheckExact(o)) {
            /* a coroutine suspended in an await of its own is someone
             * else's to drive */
            PyObject *yf = st->coro_await_getter ? st->coro_await_getter(o, NULL)
                                                 : PyObject_GetAttr(o, st->str_cr_await);
            if (!yf) return NULL;
            int busy = yf != Py_None;
            Py_DECREF(yf);
            if (busy) {
                PyErr_SetString(PyExc_RuntimeError, "coroutine is being awaited already");
                return NULL;
            }
        }
        return Py_NewRef(o);
    }
    unaryfunc getter = Py_TYPE(o)->tp_as_async ? Py_TYPE(o)->tp_as_async->am_await : NULL;
    if (!getter) {
        PyErr_Format(PyExc_TypeError, "object %.100s can't be used in 'await' expression",
                     Py_TYPE(o)->tp_name);
        return NULL;
    }
    PyObject *res = getter(o);
    if (!res) return NULL;
    if (PyCoro_CheckExact(res) ||
        (PyGen_CheckExact(res) &&
         (PyGen_GetCode((PyGenObject *)res)->co_flags & CO_ITERABLE_COROUTINE))) {
        PyErr_SetString(PyExc_TypeError, "__await__() returned a coroutine");
        Py_DECREF(res);
        return NULL;
    }
    if (!PyIter_Check(res)) {
        PyErr_Format(PyExc_TypeError, "__await__() returned non-iterator of type '%.100s'",
                     Py_TYPE(res)->tp_name);
        Py_DECREF(res);
        return NULL;
    }
    return res;
}

/* Sets `exc` (stolen) as the raised exception, with `context` (stolen) as
 * its __context__ unless it already is in its chain: what raising inside
 * an `except` block does. */
static void raise_with_context(PyObject *exc, PyObject *context) {
    if (context && context != exc) {
        PyObject *c = PyException_GetContext(exc);
        if (!c) PyException_SetContext(exc, context);
        else {
            Py_DECREF(c);
            Py_DECREF(context);
        }
    } else {
        Py_XDECREF(context);
    }
    PyErr_SetRaisedException(exc);
}

/* The end of `async with timeout: return await fut`: the awaited iterator
 * returned (*result) or raised (the current exception).  Exits the
 * Timeout with that outcome; its TimeoutError, if it raises one, wins. */
static PySendResult waitfor_finish(WaitForObject *self, PySendResult r, PyObject **result) {
    PyObject *tm = self->timeout;
    self->timeout = NULL;
    Py_CLEAR(self->inner);
    self->state = W_CLOSED;
    if (!tm) return r;
    PyObject *x;
    if (r == PYGEN_RETURN) {
        PyObject *args[3] = {Py_None, Py_None, Py_None};
        x = Timeout_aexit((TimeoutObject *)tm, args, 3);
        if (!x) {
            Py_CLEAR(*result);
            r = PYGEN_ERROR;
        }
    } else {
        PyObject *exc = PyErr_GetRaisedException();
        PyObject *tb = PyException_GetTraceback(exc);
        PyObject *args[3] = {(PyObject *)Py_TYPE(exc), exc, tb ? tb : Py_None};
        /* __aexit__ runs while `exc` is the exception being handled, as in
         * the `async with` it stands for: what it raises gets `exc` as
         * __context__, not whatever the awaiting code was handling. */
        PyObject *handled = PyErr_GetHandledException();
        PyErr_SetHandledException(exc);
        x = Timeout_aexit((TimeoutObject *)tm, args, 3);
        PyErr_SetHandledException(handled);
        Py_XDECREF(handled);
        Py_XDECREF(tb);
        if (x) PyErr_SetRaisedException(exc); /* __aexit__ never swallows */
        else raise_with_context(PyErr_GetRaisedException(), exc);
    }
    Py_XDECREF(x);
    Py_DECREF(tm);
    return r;
}

/* The StopIteration that ends a throw() or send() call: its value. */
static PySendResult fetch_return(PyObject **result) {
    if (!PyErr_ExceptionMatches(PyExc_StopIteration)) return PYGEN_ERROR;
    PyObject *e = PyErr_GetRaisedException();
    PyObject *v = ((PyStopIterationObject *)e)->value;
    *result = Py_NewRef(v ? v : Py_None);
    Py_DECREF(e);
    return PYGEN_RETURN;
}

/* getattr(o, name, None) without None: 1 found, 0 not, -1 error. */
static int optional_attr(PyObject *o, PyObject *name, PyObject **out) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(o, name, out);
#else
    *out = PyObject_GetAttr(o, name);
    if (*out) return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    return 0;
#endif
}

/* Calls close() of an iterator, if it has one. */
static int close_iter(core_state *st, PyObject *it) {
    PyObject *meth;
    if (optional_attr(it, st->str_close, &meth) < 0) return -1;
    if (!meth) return 0;
    PyObject *r = PyObject_CallNoArgs(meth);
    Py_DECREF(meth);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* throw(exc) into the awaited iterator, as `yield from` does: GeneratorExit
 * closes it and is raised here; an iterator without throw() lets the
 * exception be raised here. */
static PySendResult waitfor_throw_inner(WaitForObject *self, PyObject *exc, PyObject **result) {
    core_state *st = self->st;
    PyObject *inner = self->inner;
    if (PyErr_GivenExceptionMatches(exc, PyExc_GeneratorExit)) {
        if (close_iter(st, inner) < 0) return PYGEN_ERROR; /* that error is raised instead */
        PyErr_SetRaisedException(Py_NewRef(exc));
        return PYGEN_ERROR;
    }
    PyObject *meth;
    int found = optional_attr(inner, st->str_throw, &meth);
    if (found < 0) return PYGEN_ERROR;
    if (!found) {
        PyErr_SetRaisedException(Py_NewRef(exc));
        return PYGEN_ERROR;
    }
    PyObject *ret = PyObject_CallOneArg(meth, exc);
    Py_DECREF(meth);
    if (ret) {
        *result = ret;
        return PYGEN_NEXT;
    }
    return fetch_return(result);
}

/* The first send(None): the body up to the first suspension. */
static PySendResult waitfor_start(WaitForObject *self, PyObject **result) {
    core_state *st = self->st;
    PyObject *fut = self->fut, *delay = self->delay;
    self->fut = self->delay = NULL;
    self->state = W_CLOSED; /* until the Timeout is entered */
    PySendResult r = PYGEN_ERROR;
    PyObject *inner = NULL;
    if (delay != Py_None) {
        int nonpositive;
        int overflow;
        long v;
        if (PyFloat_CheckExact(delay)) nonpositive = PyFloat_AS_DOUBLE(delay) <= 0.0;
        else if (PyLong_CheckExact(delay) &&
                 ((v = PyLong_AsLongAndOverflow(delay, &overflow)) != -1 || !PyErr_Occurred()))
            nonpositive = overflow ? overflow < 0 : v <= 0;
        else {
            PyObject *zero = PyLong_FromLong(0);
            nonpositive = zero ? PyObject_RichCompareBool(delay, zero, Py_LE) : -1;
            Py_XDECREF(zero);
        }
        if (nonpositive < 0) goto done;
        if (nonpositive) {
            if (!st->wait_for_nonpositive) {
                PyErr_SetString(PyExc_RuntimeError, "bucketimer.aio is not initialised");
                goto done;
            }
            PyObject *loop = need_running_loop(st);
            if (!loop) goto done;
            inner = PyObject_CallFunctionObjArgs(st->wait_for_nonpositive, fut, loop, NULL);
            Py_DECREF(loop);
            if (!inner) goto done;
            self->state = W_SUSPENDED;
            self->inner = inner;
            r = PyIter_Send(inner, Py_None, result);
            if (r != PYGEN_NEXT) r = waitfor_finish(self, r, result);
            goto done;
        }
    }
    /* timeout(delay) and its __aenter__, back to back as in asyncio's
     * wait_for: the same running loop, and the clock read once (asyncio
     * reads it twice, a few hundred ns apart, and schedules in between
     * nothing that could tell). */
    PyObject *loop = need_running_loop(st);
    if (!loop) goto done;
    int64_t now_ns;
    PyObject *tm = timeout_on_loop(st, loop, delay, &now_ns);
    if (!tm || timeout_enter((TimeoutObject *)tm, loop, now_ns) < 0) {
        Py_XDECREF(tm);
        Py_DECREF(loop);
        goto done;
    }
    Py_DECREF(loop);
    self->timeout = tm;
    self->state = W_SUSPENDED;
    inner = awaitable_iter(st, fut);
    if (!inner) {
        r = waitfor_finish(self, PYGEN_ERROR, result);
        goto done;
    }
    self->inner = inner;
    r = PyIter_Send(inner, Py_None, result);
    if (r != PYGEN_NEXT) r = waitfor_finish(self, r, result);
done:
    Py_DECREF(fut);
    Py_DECREF(delay);
    return r;
}

/* One step of the coroutine: send(arg) when exc is NULL, else throw(exc). */
static PySendResult waitfor_step(WaitForObject *self, PyObject *arg, PyObject *exc,
                                 PyObject **result) {
    *result = NULL;
    if (self->running) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return PYGEN_ERROR;
    }
    if (self->state == W_CLOSED) {
        if (exc) PyErr_SetRaisedException(Py_NewRef(exc));
        else PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return PYGEN_ERROR;
    }
    if (self->state == W_CREATED) {
        if (exc) { /* thrown in before it started: nothing ran, it never will */
            self->state = W_CLOSED;
            Py_CLEAR(self->fut);
            Py_CLEAR(self->delay);
            PyErr_SetRaisedException(Py_NewRef(exc));
            return PYGEN_ERROR;
        }
        if (arg != Py_None) {
            PyErr_SetString(PyExc_TypeError,
                            "can't send non-None value to a just-started coroutine");
            return PYGEN_ERROR;
        }
    }
    self->running = 1;
    PySendResult r;
    if (self->state == W_CREATED) {
        r = waitfor_start(self, result);
    } else {
        r = exc ? waitfor_throw_inner(self, exc, result) : PyIter_Send(self->inner, arg, result);
        if (r != PYGEN_NEXT) r = waitfor_finish(self, r, result);
    }
    self->running = 0;
    return r;
}

static PySendResult WaitFor_am_send(WaitForObject *self, PyObject *arg, PyObject **result) {
    PySendResult r = waitfor_step(self, arg, NULL, result);
    if (r == PYGEN_ERROR) *result = NULL;
    return r;
}

/* The outcome of a step as a call's: a yielded value, or StopIteration. */
static PyObject *step_as_call(WaitForObject *self, PySendResult r, PyObject *result) {
    if (r == PYGEN_NEXT) return result;
    if (r == PYGEN_RETURN) {
        raise_stop_iteration(self->st, result);
        Py_DECREF(result);
    }
    return NULL;
}

static PyObject *WaitFor_iternext(WaitForObject *self) {
    PyObject *result;
    PySendResult r = waitfor_step(self, Py_None, NULL, &result);
    if (r == PYGEN_RETURN && result == Py_None) { /* StopIteration(None), unraised */
        Py_DECREF(result);
        return NULL;
    }
    return step_as_call(self, r, result);
}

static PyObject *WaitFor_send(WaitForObject *self, PyObject *arg) {
    PyObject *result;
    PySendResult r = waitfor_step(self, arg, NULL, &result);
    return step_as_call(self, r, result);
}

/* throw(exc) or the older throw(type[, value[, traceback]]) */
static PyObject *WaitFor_throw(WaitForObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *exc = throw_args_exception(args, nargs);
    if (!exc) return NULL;
    PyObject *result;
    PySendResult r = waitfor_step(self, NULL, exc, &result);
    Py_DECREF(exc);
    return step_as_call(self, r, result);
}

/* close(): GeneratorExit at the suspension point (after closing the awaited
 * iterator), which exits the Timeout and so cancels its timer. */
static PyObject *WaitFor_close(WaitForObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->state == W_CREATED) {
        self->state = W_CLOSED;
        Py_CLEAR(self->fut);
        Py_CLEAR(self->delay);
        Py_RETURN_NONE;
    }
    if (self->state == W_CLOSED) Py_RETURN_NONE;
    if (self->running) {
        PyErr_SetString(PyExc_ValueError, "coroutine already executing");
        return NULL;
    }
    self->running = 1;
    if (close_iter(self->st, self->inner) == 0) PyErr_SetNone(PyExc_GeneratorExit);
    PyObject *result = NULL;
    (void)waitfor_finish(self, PYGEN_ERROR, &result);
    self->running = 0;
    if (PyErr_ExceptionMatches(PyExc_GeneratorExit) || PyErr_ExceptionMatches(PyExc_StopIteration)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return NULL;
}

/* Like a coroutine's: close() if suspended; "never awaited" if never started. */
static void WaitFor_finalize(WaitForObject *self) {
    if (self->state == W_CLOSED) return;
    PyObject *exc = PyErr_GetRaisedException();
    if (self->state == W_CREATED) {
        if (PyErr_WarnEx(PyExc_RuntimeWarning, "coroutine 'wait_for' was never awaited", 1) < 0)
            PyErr_WriteUnraisable((PyObject *)self);
        self->state = W_CLOSED;
    } else {
        PyObject *r = WaitFor_close(self, NULL);
        if (r) Py_DECREF(r);
        else PyErr_WriteUnraisable((PyObject *)self);
    }
    PyErr_SetRaisedException(exc);
}

static PyObject *WaitFor_await(WaitForObject *self) { return Py_NewRef(self); }

static PyObject *WaitFor_get_await(WaitForObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->state == W_SUSPENDED && self->inner ? self->inner : Py_None);
}

static PyObject *WaitFor_get_running(WaitForObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(self->running);
}

static PyObject *WaitFor_get_suspended(WaitForObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(self->state == W_SUSPENDED && !self->running);
}

static PyObject *WaitFor_get_none(WaitForObject *Py_UNUSED(self), void *Py_UNUSED(c)) {
    Py_RETURN_NONE;
}

static PyObject *WaitFor_get_name(WaitForObject *Py_UNUSED(self), void *Py_UNUSED(c)) {
    return PyUnicode_FromString("wait_for");
}

static PyObject *WaitFor_repr(WaitForObject *self) {
    return PyUnicode_FromFormat("<bucketimer wait_for coroutine object at %p>", self);
}

static PyMethodDef WaitFor_methods[] = {
    {"send", (PyCFunction)WaitFor_send, METH_O,
     "send(arg) -> send 'arg' into coroutine,\nreturn next iterated value or raise StopIteration."},
    {"throw", (PyCFunction)(void (*)(void))WaitFor_throw, METH_FASTCALL,
     "throw(value)\nthrow(type[,value[,traceback]])\n\nRaise exception in coroutine, return next "
     "iterated value or raise StopIteration."},
    {"close", (PyCFunction)WaitFor_close, METH_NOARGS, "close() -> raise GeneratorExit inside coroutine."},
    {NULL}};

static PyGetSetDef WaitFor_getset[] = {
    {"cr_await", (getter)WaitFor_get_await, NULL, "object being awaited on, or None", NULL},
    {"cr_running", (getter)WaitFor_get_running, NULL, NULL, NULL},
    {"cr_suspended", (getter)WaitFor_get_suspended, NULL, NULL, NULL},
    {"cr_frame", (getter)WaitFor_get_none, NULL, "None: this coroutine has no Python frame", NULL},
    {"cr_code", (getter)WaitFor_get_none, NULL, "None: this coroutine has no code object", NULL},
    {"__name__", (getter)WaitFor_get_name, NULL, NULL, NULL},
    {"__qualname__", (getter)WaitFor_get_name, NULL, NULL, NULL},
    {NULL}};

static PyType_Slot WaitFor_slots[] = {
    {Py_tp_doc, "The coroutine bucketimer.wait_for() returns (3.12 and later)."},
    {Py_tp_dealloc, WaitFor_dealloc},
    {Py_tp_traverse, WaitFor_traverse},
    {Py_tp_clear, WaitFor_clear},
    {Py_tp_finalize, WaitFor_finalize},
    {Py_tp_repr, WaitFor_repr},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, WaitFor_iternext},
    {Py_am_await, WaitFor_await},
    {Py_am_send, WaitFor_am_send},
    {Py_tp_methods, WaitFor_methods},
    {Py_tp_getset, WaitFor_getset},
    {0, NULL}};

static PyType_Spec WaitFor_spec = {
    .name = "bucketimer._core.WaitFor",
    .basicsize = sizeof(WaitForObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = WaitFor_slots,
};

static PyObject *core_wait_for(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"fut", "timeout"};
    PyObject *vals[2] = {NULL, NULL};
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "wait_for() takes 2 positional arguments but %zd were given",
                     nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) vals[i] = args[i];
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        int j = PyUnicode_CompareWithASCIIString(k, "fut") == 0       ? 0
                : PyUnicode_CompareWithASCIIString(k, "timeout") == 0 ? 1
                                                                      : -1;
        if (j < 0) {
            PyErr_Format(PyExc_TypeError, "wait_for() got an unexpected keyword argument %R", k);
            return NULL;
        }
        if (vals[j]) {
            PyErr_Format(PyExc_TypeError, "wait_for() got multiple values for argument '%s'",
                         names[j]);
            return NULL;
        }
        vals[j] = args[nargs + i];
    }
    for (int j = 0; j < 2; j++)
        if (!vals[j]) {
            PyErr_Format(PyExc_TypeError, "wait_for() missing required argument: '%s'", names[j]);
            return NULL;
        }
    core_state *st = get_state(m);
    WaitForObject *self = PyObject_GC_New(WaitForObject, st->WaitFor_Type);
    if (!self) return NULL;
    self->st = st;
    self->state = W_CREATED;
    self->running = 0;
    self->fut = Py_NewRef(vals[0]);
    self->delay = Py_NewRef(vals[1]);
    self->inner = self->timeout = NULL;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyObject *core_set_wait_for_nonpositive(PyObject *m, PyObject *fn) {
    Py_XSETREF(get_state(m)->wait_for_nonpositive, Py_NewRef(fn));
    Py_RETURN_NONE;
}

#endif /* 3.12 and later */

static PyObject *core_set_default_factory(PyObject *m, PyObject *fn) {
    core_state *st = get_state(m);
    Py_XSETREF(st->default_factory, Py_NewRef(fn));
    Py_CLEAR(st->default_tt);
    Py_RETURN_NONE;
}

/* ---- module ------------------------------------------------------------- */

static PyObject *core_monotonic_ns(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(bt_now_ns());
}

static PyMethodDef core_functions[] = {
    {"monotonic_ns", core_monotonic_ns, METH_NOARGS, "The core's clock, CLOCK_MONOTONIC ns."},
    {"timeout", core_timeout, METH_O,
     "timeout(delay) -> Timeout\n\nasyncio.timeout(delay), with the timer in bucketimer's core."},
    {"timeout_at", core_timeout_at, METH_O,
     "timeout_at(when) -> Timeout\n\nasyncio.timeout_at(when), with the timer in bucketimer's "
     "core."},
    {"_set_default_factory", core_set_default_factory, METH_O, NULL},
#if PY_VERSION_HEX >= 0x030C0000
    {"wait_for", (PyCFunction)(void (*)(void))core_wait_for, METH_FASTCALL | METH_KEYWORDS,
     "wait_for(fut, timeout) -> coroutine\n\nasyncio.wait_for() of 3.12 and later, with the "
     "timer in bucketimer's core."},
    {"_set_wait_for_nonpositive", core_set_wait_for_nonpositive, METH_O, NULL},
#endif
    {NULL}};

static int core_exec(PyObject *m) {
    core_state *st = get_state(m);
    st->Handle_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Handle_spec, NULL);
    if (!st->Handle_Type || PyModule_AddType(m, st->Handle_Type) < 0) return -1;
    st->Port_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Port_spec, NULL);
    if (!st->Port_Type || PyModule_AddType(m, st->Port_Type) < 0) return -1;
    st->TimerThread_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &TimerThread_spec, NULL);
    if (!st->TimerThread_Type || PyModule_AddType(m, st->TimerThread_Type) < 0) return -1;
    PyObject *events = PyImport_ImportModule("asyncio.events");
    if (!events) return -1;
    st->get_running_loop = PyObject_GetAttrString(events, "_get_running_loop");
    Py_DECREF(events);
    if (!st->get_running_loop) return -1;
    st->str_port_for = PyUnicode_InternFromString("_port_for");
    if (!st->str_port_for) return -1;
#if PY_VERSION_HEX < 0x030C0000
    pthread_once(&pid_once, install_pid_cache);
#endif
    st->str_running_loop_key = PyUnicode_InternFromString("__asyncio_running_event_loop__");
    if (!st->str_running_loop_key) return -1;
    st->Scheduler_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Scheduler_spec, NULL);
    if (!st->Scheduler_Type || PyModule_AddType(m, st->Scheduler_Type) < 0) return -1;
    st->Ready_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Ready_spec, NULL);
    if (!st->Ready_Type) return -1;
    st->ready_none = ready_new(st, Py_None);
    if (!st->ready_none) return -1;
    st->Timeout_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Timeout_spec, NULL);
    if (!st->Timeout_Type || PyModule_AddType(m, st->Timeout_Type) < 0) return -1;
    PyObject *tasks = PyImport_ImportModule("asyncio.tasks");
    if (!tasks) return -1;
    st->current_task = PyObject_GetAttrString(tasks, "current_task");
    PyObject *task_type = PyObject_GetAttrString(tasks, "Task");
    if (task_type && PyType_Check(task_type)) {
        st->task_type = (PyTypeObject *)task_type;
        st->task_cancelling = PyObject_GetAttrString(task_type, "cancelling");
        if (!st->task_cancelling) PyErr_Clear();
    } else {
        Py_XDECREF(task_type);
        PyErr_Clear();
    }
    PyObject *ct = PyObject_GetAttrString(tasks, "_current_tasks");
    Py_DECREF(tasks);
    if (!st->current_task) return -1;
    /* 3.11-3.13 keep the loop -> current task map in this dict (the C
     * module's); read it directly if it is one, else ask current_task(). */
    if (ct && PyDict_CheckExact(ct)) st->current_tasks = ct;
    else {
        Py_XDECREF(ct);
        PyErr_Clear();
    }
    PyObject *exc = PyImport_ImportModule("asyncio.exceptions");
    if (!exc) return -1;
    st->CancelledError = PyObject_GetAttrString(exc, "CancelledError");
    Py_DECREF(exc);
    if (!st->CancelledError) return -1;
    st->ExceptionGroup = Py_NewRef(PyExc_Exception);
    PyObject *builtins = PyImport_ImportModule("builtins");
    if (builtins) {
        PyObject *eg = PyObject_GetAttrString(builtins, "ExceptionGroup");
        Py_DECREF(builtins);
        if (eg) Py_SETREF(st->ExceptionGroup, eg);
    }
    PyErr_Clear();
    PyObject *to = PyImport_ImportModule("asyncio.timeouts");
    if (!to) return -1;
    PyObject *tcls = PyObject_GetAttrString(to, "Timeout");
    Py_DECREF(to);
    if (!tcls) return -1;
    /* Present from 3.13: the running asyncio's exit semantics follow it. */
    st->insert_timeout_error = PyObject_GetAttrString(tcls, "_insert_timeout_error");
    Py_DECREF(tcls);
    if (!st->insert_timeout_error) PyErr_Clear();
#define INTERN(field, text)                                 \
    if (!(st->field = PyUnicode_InternFromString(text))) return -1;
    INTERN(str_time, "time");
    INTERN(str_call_soon, "call_soon");
    INTERN(str_cancelling, "cancelling");
    INTERN(str_uncancel, "uncancel");
    INTERN(str_cancel, "cancel");
    INTERN(str_cr_await, "cr_await");
    INTERN(str_close, "close");
    INTERN(str_throw, "throw");
#undef INTERN
#if PY_VERSION_HEX >= 0x030C0000
    st->WaitFor_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &WaitFor_spec, NULL);
    if (!st->WaitFor_Type || PyModule_AddType(m, st->WaitFor_Type) < 0) return -1;
    for (PyGetSetDef *g = PyCoro_Type.tp_getset; g && g->name; g++)
        if (strcmp(g->name, "cr_await") == 0 && !g->closure) st->coro_await_getter = g->get;
#endif
    PyObject *base_events = PyImport_ImportModule("asyncio.base_events");
    if (!base_events) return -1;
    PyObject *bel = PyObject_GetAttrString(base_events, "BaseEventLoop");
    Py_DECREF(base_events);
    if (!bel) return -1;
    st->stock_time = PyObject_GetAttr(bel, st->str_time);
    Py_DECREF(bel);
    if (!st->stock_time) return -1;
    if (PyModule_AddIntConstant(m, "CANCELLED", BT_CANCELLED) < 0) return -1;
    if (PyModule_AddIntConstant(m, "TOO_LATE", BT_TOO_LATE) < 0) return -1;
    if (PyModule_AddIntConstant(m, "UNKNOWN", BT_UNKNOWN) < 0) return -1;
    return 0;
}

static int core_traverse(PyObject *m, visitproc visit, void *arg) {
    core_state *st = get_state(m);
    Py_VISIT(st->TimerThread_Type);
    Py_VISIT(st->Handle_Type);
    Py_VISIT(st->Port_Type);
    Py_VISIT(st->get_running_loop);
    Py_VISIT(st->Scheduler_Type);
    Py_VISIT(st->Timeout_Type);
    Py_VISIT(st->Ready_Type);
    Py_VISIT(st->ready_none);
    Py_VISIT(st->stop_iteration);
    Py_VISIT(st->WaitFor_Type);
    Py_VISIT(st->wait_for_nonpositive);
    Py_VISIT(st->task_type);
    Py_VISIT(st->task_cancelling);
    Py_VISIT(st->current_tasks);
    Py_VISIT(st->current_task);
    Py_VISIT(st->CancelledError);
    Py_VISIT(st->ExceptionGroup);
    Py_VISIT(st->insert_timeout_error);
    Py_VISIT(st->default_factory);
    Py_VISIT(st->default_tt);
    Py_VISIT(st->stock_time);
    return 0;
}

static int core_clear(PyObject *m) {
    core_state *st = get_state(m);
    Py_CLEAR(st->TimerThread_Type);
    Py_CLEAR(st->Handle_Type);
    Py_CLEAR(st->Port_Type);
    Py_CLEAR(st->get_running_loop);
    Py_CLEAR(st->str_port_for);
    Py_CLEAR(st->Scheduler_Type);
    Py_CLEAR(st->Timeout_Type);
    Py_CLEAR(st->Ready_Type);
    Py_CLEAR(st->ready_none);
    if (st->ready_spare) {
        PyObject_Free(st->ready_spare);
        st->ready_spare = NULL;
    }
    Py_CLEAR(st->stop_iteration);
    while (st->timeout_nfree > 0) PyObject_GC_Del(st->timeout_free[--st->timeout_nfree]);
    Py_CLEAR(st->WaitFor_Type);
    Py_CLEAR(st->wait_for_nonpositive);
    Py_CLEAR(st->task_type);
    Py_CLEAR(st->task_cancelling);
    Py_CLEAR(st->str_cr_await);
    Py_CLEAR(st->str_close);
    Py_CLEAR(st->str_throw);
    Py_CLEAR(st->current_tasks);
    Py_CLEAR(st->current_task);
    Py_CLEAR(st->CancelledError);
    Py_CLEAR(st->ExceptionGroup);
    Py_CLEAR(st->insert_timeout_error);
    Py_CLEAR(st->default_factory);
    Py_CLEAR(st->default_tt);
    Py_CLEAR(st->str_time);
    Py_CLEAR(st->str_call_soon);
    Py_CLEAR(st->str_cancelling);
    Py_CLEAR(st->str_uncancel);
    Py_CLEAR(st->str_cancel);
    Py_CLEAR(st->stock_time);
    Py_CLEAR(st->str_running_loop_key);
#if PY_VERSION_HEX < 0x030C0000
    Py_CLEAR(st->holder_type);
#endif
    return 0;
}

static void core_free(void *m) { core_clear((PyObject *)m); }

/* No Py_mod_gil slot: a free-threaded CPython re-enables the GIL when it
 * imports this module (and says so).  The per-object paths are written for
 * it (atomic handle states, the free lists compiled out), but the module
 * state's caches (the default TimerThread, the loop-type time check) are
 * updated without a lock, and no free-threaded build exists here to test
 * a claim that they need none. */
static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
    {0, NULL}};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "bucketimer._core",
    .m_doc = "The CPython module over bucketimer's native timer core.",
    .m_size = sizeof(core_state),
    .m_methods = core_functions,
    .m_slots = core_slots,
    .m_traverse = core_traverse,
    .m_clear = core_clear,
    .m_free = core_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
