/*
 * timeout.c -- Timeout, timeout() and timeout_at().
 */
#include "module.h"

/* ---- Ready: an awaitable that is already done ----------------------------
 * What Timeout.__aenter__/__aexit__ return: awaiting it never suspends. */

typedef struct {
    PyObject_HEAD
    core_state *st;
    PyObject *value;
} ReadyObject;

PyObject *ready_new(core_state *st, PyObject *value) {
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

static PyObject *Ready_iternext(ReadyObject *self) {
    if (self->value == Py_None) return NULL; /* exhausted: the result is None */
    return raise_stop_iteration(self->st, self->value);
}

/* The exception a coroutine's throw(exc) or throw(type[, value[, tb]]) is
 * asked to raise, checked as generators check it; NULL with an error set. */
PyObject *throw_args_exception(PyObject *const *args, Py_ssize_t nargs) {
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

PyType_Spec Ready_spec = {
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

static const char *const timeout_state_names[] = {"created", "active", "expiring", "expired",
                                                   "finished"};

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

PyObject *need_running_loop(core_state *st) {
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
int timeout_enter(TimeoutObject *self, PyObject *loop, int64_t now_ns) {
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

PyObject *Timeout_aexit(TimeoutObject *self, PyObject *const *args, Py_ssize_t nargs) {
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

PyObject *timeout_fire(PyObject *timeout) {
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

PyType_Spec Timeout_spec = {
    .name = "bucketimer.Timeout",
    .basicsize = sizeof(TimeoutObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Timeout_slots,
};

/* timeout(delay) on the running `loop`: a Timeout due at loop.time() +
 * delay.  *now_ns gets the stock clock's reading if that is what was read,
 * else -1. */
PyObject *timeout_on_loop(core_state *st, PyObject *loop, PyObject *delay, int64_t *now_ns) {
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

PyObject *core_timeout(PyObject *m, PyObject *delay) {
    core_state *st = get_state(m);
    PyObject *loop = need_running_loop(st);
    if (!loop) return NULL;
    int64_t now_ns;
    PyObject *t = timeout_on_loop(st, loop, delay, &now_ns);
    Py_DECREF(loop);
    return t;
}

PyObject *core_timeout_at(PyObject *m, PyObject *when) {
    return timeout_make(get_state(m), when);
}
