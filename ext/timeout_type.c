/*
 * timeout_type.c -- bucketimer.Timeout, timeout() and timeout_at(): asyncio's
 * Timeout with its timer in the core.  A Timeout, its Steps and the module
 * state's loop-clock cache are touched only with the GIL held, on the
 * loop's thread (the expiry runs there too, from the loop's Port).
 *
 * The state machine is asyncio.timeouts.Timeout's of the running Python.
 * 3.11 and 3.12 turn exactly the CancelledError their expiry caused into
 * TimeoutError; from 3.13 a subclass of it too, and a TimeoutError is put
 * into the context chain of any other exception raised while the
 * cancellation was handled.  docs/asyncio.rst says which release follows
 * which.  What makes it cheap: __aenter__ and __aexit__ return a Step, an
 * awaitable that does its work the first time it is driven and never
 * suspends, and the expiry timer is a Handle whose callback is the Timeout
 * itself (no bound method, no context copy).
 */
#include "module.h"

static const char *const timeout_state_names[] = {"created", "active", "expiring", "expired",
                                                   "finished"};

/* ---- the loop's clock ------------------------------------------------------ */

/* The kind of clock a loop class's `time` is (EXT_CLOCK_*). */
static int clock_kind(ext_state *st, PyObject *f) {
    if (f == st->stock_time) return EXT_CLOCK_STOCK;
    PyObject *clocks = st->monotonic_clocks;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(clocks); i++)
        if (PyList_GET_ITEM(clocks, i) == f) return EXT_CLOCK_MONOTONIC;
    return EXT_CLOCK_FOREIGN;
}

/* The kind of `tp`'s `time`, cached for the last class seen.  The cache is
 * keyed on the class's version tag too, which CPython changes whenever an
 * attribute of the class or of a base is set (mock.patch.object on the
 * class): a tag of 0 is no tag, and is never trusted. */
static int type_clock(ext_state *st, PyTypeObject *tp) {
    if (tp == st->time_checked_type && tp->tp_version_tag != 0 &&
        tp->tp_version_tag == st->time_checked_tag)
        return st->time_checked_kind;
    /* The lookup may run Python code (a metaclass's) that sets the class's
     * `time`: the answer is cached only under a tag that held throughout. */
    unsigned int tag = tp->tp_version_tag;
    PyObject *f = PyObject_GetAttr((PyObject *)tp, st->str_time);
    if (!f) return -1;
    int kind = clock_kind(st, f);
    Py_DECREF(f);
    if (tag != 0 && tag == tp->tp_version_tag) {
        st->time_checked_type = tp;
        st->time_checked_tag = tag;
        st->time_checked_kind = kind;
    }
    return kind;
}

/* Whether `loop` has a `time` of its own (mock.patch.object(loop, "time")),
 * shadowing its class's, which is a clock of `kind`: loop.time must be a
 * function of that kind bound to the loop (every known clock is a Python
 * or Cython function, bound as a method).  Asked without reading the
 * instance's __dict__ (compat.c says why). */
static int instance_has_time(ext_state *st, PyObject *loop, int kind) {
    if (Py_TYPE(loop)->tp_dictoffset == 0) return 0;
    PyObject *f = ext_loop_time_function(&st->compat, loop);
    if (!f) return -1;
    int own = clock_kind(st, f) != kind;
    Py_DECREF(f);
    return own;
}

int ext_loop_clock(ext_state *st, PyObject *loop) {
    int kind = type_clock(st, Py_TYPE(loop));
    if (kind <= EXT_CLOCK_FOREIGN) return kind;
    int shadowed = instance_has_time(st, loop, kind);
    return shadowed < 0 ? -1 : shadowed ? EXT_CLOCK_FOREIGN : kind;
}

PyObject *ext_loop_clock_is_foreign(PyObject *m, PyObject *loop) {
    int kind = ext_loop_clock(ext_state_of_module(m), loop);
    return kind < 0 ? NULL : PyBool_FromLong(kind == EXT_CLOCK_FOREIGN);
}

PyObject *ext_add_monotonic_clock(PyObject *m, PyObject *time) {
    ext_state *st = ext_state_of_module(m);
    if (PyList_Append(st->monotonic_clocks, time) < 0) return NULL;
    st->time_checked_type = NULL; /* the cached answer may change */
    Py_RETURN_NONE;
}

/* loop.time(); the stock clock is read directly (time.monotonic() computes
 * the same double from the same ns), which on 3.12 saves a quarter of an
 * `async with timeout()`. */
static PyObject *loop_time(ext_state *st, PyObject *loop, int kind) {
    if (kind == EXT_CLOCK_STOCK) return PyFloat_FromDouble((double)bt_now_ns() / 1e9);
    return PyObject_CallMethodNoArgs(loop, st->str_time);
}

/* `when <= loop.time()`, as asyncio's reschedule() asks it, on a loop whose
 * clock is of `kind`.  `now_ns`, if not negative, is the stock clock read a
 * moment ago by the same caller (no Python code ran in between).  `when` is
 * the caller's own reference: loop.time() and the comparison run Python
 * code, which may reschedule the Timeout it came from. */
static int deadline_reached(ext_state *st, PyObject *loop, int kind, PyObject *when,
                            int64_t now_ns) {
    if (kind == EXT_CLOCK_STOCK && PyFloat_CheckExact(when))
        return PyFloat_AS_DOUBLE(when) <= (double)(now_ns >= 0 ? now_ns : bt_now_ns()) / 1e9;
    PyObject *now = loop_time(st, loop, kind);
    if (!now) return -1;
    int past = PyObject_RichCompareBool(when, now, Py_LE);
    Py_DECREF(now);
    return past;
}

PyObject *ext_need_running_loop(ext_state *st) {
    PyObject *loop = ext_running_loop(&st->compat);
    if (loop == Py_None) {
        Py_DECREF(loop);
        PyErr_SetString(PyExc_RuntimeError, "no running event loop");
        return NULL;
    }
    return loop;
}

/* ---- the Timeout object ---------------------------------------------------- */

EXT_GC_TRAVERSE(Timeout, TimeoutObject, TIMEOUT_REFS)

/* Cleared by the GC, a Timeout is finished: a finaliser that reaches it
 * afterwards finds a state whose every method needs none of its fields. */
static int Timeout_clear(TimeoutObject *self) {
    self->state = T_EXITED;
    TIMEOUT_REFS(EXT_CLEAR_REF)
    return 0;
}

static void Timeout_dealloc(TimeoutObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    Timeout_clear(self);
    ext_state *st = ext_state_alive(tp);
    if (st && tp == st->Timeout_Type && ext_freelist_put(&st->timeouts, (PyObject *)self))
        return;
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *timeout_make(ext_state *st, PyObject *when) {
    TimeoutObject *self = (TimeoutObject *)ext_freelist_take(&st->timeouts, st->Timeout_Type);
    if (!self && !(self = PyObject_GC_New(TimeoutObject, st->Timeout_Type))) return NULL;
    self->st = st;
    self->state = T_CREATED;
    self->cancelling = 0;
    self->when = Py_NewRef(when);
    self->handler = self->task = self->on_timeout = self->step = NULL;
    self->weakreflist = NULL;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyObject *Timeout_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"when", NULL};
    PyObject *when;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Timeout", kwlist, &when)) return NULL;
    ext_state *st = ext_state_of_type(type);
    return st ? timeout_make(st, when) : NULL;
}

/* ---- arming and disarming the expiry ---------------------------------------
 * Arming runs Python code: loop.time(), the loop's call_soon or call_at, the
 * deadline's __float__ or __le__, a stand-in handle's cancel(), making the
 * default TimerThread.  That code may reschedule or exit the very Timeout
 * being armed.  So the deadline is held by a reference of the arming's own
 * (never read again from self->when), and after each such call the arming
 * asks whether it was overtaken: a reschedule or an exit made meanwhile,
 * which started later, wins; the arming then leaves the expiry as that call
 * left it, and cancels a handle it made itself.  One expiry is armed at a
 * time, and self->handler is always the one armed (docs/design.rst). */

static int cancel_any_handle(ext_state *st, PyObject *h) {
    if (Py_IS_TYPE(h, st->Handle_Type)) {
        ext_handle_cancel((HandleObject *)h);
        return 0;
    }
    PyObject *r = PyObject_CallMethodNoArgs(h, st->str_cancel);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static int timeout_disarm(TimeoutObject *self) {
    PyObject *h = self->handler;
    if (!h) return 0;
    self->handler = NULL;
    int rc = cancel_any_handle(self->st, h);
    Py_DECREF(h);
    return rc;
}

/* Whether an arming for `when` was overtaken by Python code that ran since
 * it began (it armed with no expiry armed). */
static int overtaken(TimeoutObject *self, PyObject *when) {
    return self->state != T_ENTERED || self->when != when || self->handler != NULL;
}

static PyObject *Timeout_on_timeout(TimeoutObject *self, PyObject *Py_UNUSED(ignored));
static PyMethodDef on_timeout_def = {"_on_timeout", (PyCFunction)Timeout_on_timeout, METH_NOARGS,
                                     NULL};

/* self._on_timeout, a new reference; made once, on first arming on a loop. */
static PyObject *on_timeout_method(TimeoutObject *self) {
    if (!self->on_timeout) {
        PyObject *m = PyCFunction_New(&on_timeout_def, (PyObject *)self);
        if (!m) return NULL;
        if (!self->on_timeout) self->on_timeout = m; /* (the allocation may have run the GC) */
        else Py_DECREF(m);
    }
    return Py_NewRef(self->on_timeout);
}

/* A deadline already reached goes to loop.call_soon, as in asyncio: it
 * fires on the very next iteration, in order with other ready callbacks,
 * after the core's timers due for this loop (ext_deliver_due). */
static PyObject *expire_soon(TimeoutObject *self, PyObject *loop) {
    PyObject *cb = on_timeout_method(self);
    if (!cb) return NULL;
    PyObject *h = ext_deliver_due(self->st, loop) < 0
                      ? NULL
                      : PyObject_CallMethodOneArg(loop, self->st->str_call_soon, cb);
    Py_DECREF(cb);
    return h;
}

/* A loop with a clock of its own (a virtual one) gets asyncio's path:
 * loop.call_at(when, self._on_timeout), whose timer follows that clock. */
static PyObject *expire_on_loop(TimeoutObject *self, PyObject *loop, PyObject *when) {
    PyObject *cb = on_timeout_method(self);
    if (!cb) return NULL;
    PyObject *h = PyObject_CallMethodObjArgs(loop, self->st->str_call_at, when, cb, NULL);
    Py_DECREF(cb);
    return h;
}

/* A deadline in the future goes to the core: the handle expires this
 * Timeout directly.  The default TimerThread is held across the schedule,
 * whose Python code (the port's _attach, loop.is_closed()) may close and
 * replace it. */
static PyObject *expire_at(TimeoutObject *self, PyObject *loop, PyObject *when) {
    double t;
    if (ext_to_seconds(when, "when", &t) < 0) return NULL;
    /* The default TimerThread, held: scheduling runs Python code (the
     * loop's is_closed, __hash__, the port's attach), which may close it
     * and make another.  Then the new default takes the timer, once. */
    PyObject *h = NULL;
    for (int tries = 0; tries < 2 && !h; tries++) {
        PyObject *tt = Py_XNewRef((PyObject *)ext_default_tt(self->st));
        if (!tt) return NULL;
        h = ext_check_open((TimerThreadObject *)tt) < 0
                ? NULL
                : ext_schedule((TimerThreadObject *)tt, 1, t, (PyObject *)self, NULL, 0, loop,
                               NULL, EXT_SCHED_TIMEOUT);
        int replaced = !h && ((TimerThreadObject *)tt)->closed &&
                       (PyObject *)self->st->default_tt != tt &&
                       PyErr_ExceptionMatches(PyExc_RuntimeError);
        Py_DECREF(tt);
        if (!replaced) break;
        PyErr_Clear();
    }
    return h;
}

/* Arms the expiry for `when` (the caller's reference, self->when when the
 * arming began) on the running `loop` (`now_ns` as for deadline_reached()). */
static int arm_for(TimeoutObject *self, PyObject *loop, int64_t now_ns, PyObject *when) {
    int kind = now_ns >= 0 ? EXT_CLOCK_STOCK : ext_loop_clock(self->st, loop);
    if (kind < 0) return -1;
    int past = deadline_reached(self->st, loop, kind, when, now_ns);
    if (past < 0) return -1;
    if (overtaken(self, when)) return 0;
    /* A NaN deadline is never reached, and asyncio's heap fires it at once
     * (its `handle._when >= end_time` is false too): so does this. */
    if (!past && kind != EXT_CLOCK_FOREIGN && PyFloat_Check(when) &&
        isnan(PyFloat_AS_DOUBLE(when)))
        past = 1;
    PyObject *h = past                         ? expire_soon(self, loop)
                  : kind == EXT_CLOCK_FOREIGN ? expire_on_loop(self, loop, when)
                                              : expire_at(self, loop, when);
    if (!h) return -1;
    if (overtaken(self, when)) { /* what overtook it stands; this one never fires */
        int rc = cancel_any_handle(self->st, h);
        Py_DECREF(h);
        return rc;
    }
    self->handler = h;
    return 0;
}

/* What asyncio's reschedule(self._when) does once its state check passed:
 * drops the expiry armed (one a reschedule made while entering, say) and
 * arms one for self->when on the running `loop`. */
static int timeout_arm(TimeoutObject *self, PyObject *loop, int64_t now_ns) {
    if (timeout_disarm(self) < 0) return -1;
    PyObject *when = self->when;
    if (!when || when == Py_None || overtaken(self, when)) return 0;
    Py_INCREF(when);
    int rc = arm_for(self, loop, now_ns, when);
    Py_DECREF(when);
    return rc;
}

/* reschedule() to a later deadline, in place: the expiry Handle stays and
 * the core moves its timer (bt_postpone), leaving no cancelled entry behind.
 * 1: done (or overtaken by a reschedule or exit made meanwhile); 0: not here
 * (no Handle of ours pending on the running loop, a deadline not a plain
 * number or already reached, or earlier than the armed one): the caller
 * disarms and arms, as asyncio does; -1: error.  `when` is the caller's. */
static int timeout_postpone(TimeoutObject *self, PyObject *when) {
    ext_state *st = self->st;
    PyObject *armed = self->handler;
    if (!armed || !Py_IS_TYPE(armed, st->Handle_Type)) return 0;
    HandleObject *h = (HandleObject *)armed;
    if (atomic_load_explicit(&h->state, memory_order_acquire) != H_PENDING || !h->port || !h->tt)
        return 0;
    if (!PyFloat_CheckExact(when) && !PyLong_CheckExact(when)) return 0;
    double t = PyFloat_CheckExact(when) ? PyFloat_AS_DOUBLE(when) : PyLong_AsDouble(when);
    if (t == -1.0 && PyErr_Occurred()) {
        PyErr_Clear(); /* the general path raises it, in asyncio's order */
        return 0;
    }
    Py_INCREF(h); /* across loop.time(), which may reschedule and drop it */
    int rc = -1;
    PyObject *loop = ext_running_loop(&st->compat);
    if (loop) {
        int ours = loop == h->port->loop;
        int kind = ours ? ext_loop_clock(st, loop) : EXT_CLOCK_FOREIGN;
        int past = kind > EXT_CLOCK_FOREIGN ? deadline_reached(st, loop, kind, when, -1) : 0;
        Py_DECREF(loop);
        if (kind < 0 || past < 0) rc = -1;
        else if (self->handler != armed || self->when != when || self->state != T_ENTERED)
            rc = 1;
        else if (kind == EXT_CLOCK_FOREIGN || past || isnan(t)) rc = 0;
        else rc = ext_handle_postpone(h, t);
    }
    Py_DECREF(h);
    return rc;
}

static PyObject *Timeout_reschedule(TimeoutObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames) {
    PyObject *when;
    if (ext_one_arg(args, nargs, kwnames, "reschedule", "when", &when) < 0) return NULL;
    if (self->state != T_ENTERED) {
        if (self->state == T_CREATED)
            PyErr_SetString(PyExc_RuntimeError, "Timeout has not been entered");
        else
            PyErr_Format(PyExc_RuntimeError, "Cannot change state of %s Timeout",
                         timeout_state_names[self->state]);
        return NULL;
    }
    Py_SETREF(self->when, Py_NewRef(when)); /* the old deadline's __del__ may run */
    if (self->state != T_ENTERED || self->when != when) Py_RETURN_NONE; /* overtaken */
    if (when != Py_None) {
        int moved = timeout_postpone(self, when);
        if (moved < 0) return NULL;
        if (moved) Py_RETURN_NONE;
    }
    if (timeout_disarm(self) < 0) return NULL;
    if (when == Py_None) Py_RETURN_NONE;
    PyObject *loop = ext_need_running_loop(self->st);
    if (!loop) return NULL;
    int rc = timeout_arm(self, loop, -1);
    Py_DECREF(loop);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* The expiry: the task is cancelled.  task.cancel() may run Python code (a
 * Task subclass's, a future's) that exits or reschedules this Timeout. */
static PyObject *Timeout_on_timeout(TimeoutObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->state != T_ENTERED || !self->task) Py_RETURN_NONE; /* cannot happen: cancel won */
    PyObject *task = Py_NewRef(self->task);
    PyObject *fired = Py_XNewRef(self->handler);
    PyObject *r = PyObject_CallMethodNoArgs(task, self->st->str_cancel);
    Py_DECREF(task);
    int rc = r ? 0 : -1;
    Py_XDECREF(r);
    if (rc == 0) {
        if (self->state == T_ENTERED) self->state = T_EXPIRING;
        if (self->handler == fired) Py_CLEAR(self->handler); /* drop it early, as asyncio does */
        else rc = timeout_disarm(self); /* re-armed meanwhile: an expiring Timeout needs none */
    }
    Py_XDECREF(fired);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

PyObject *ext_timeout_fire(PyObject *timeout) {
    return Timeout_on_timeout((TimeoutObject *)timeout, NULL);
}

/* ---- entering ----------------------------------------------------------------- */

/* task.cancelling().  For asyncio's own Task type the method is called
 * through its descriptor, which skips looking in the task's __dict__. */
static PyObject *task_cancelling(ext_state *st, PyObject *task) {
    if (Py_TYPE(task) == st->task_type && st->task_cancelling)
        return PyObject_Vectorcall(st->task_cancelling, &task, 1, NULL);
    return PyObject_CallMethodNoArgs(task, st->str_cancelling);
}

/* What __aenter__ does, on the running `loop` (`now_ns` as for
 * deadline_reached(): it is dropped if a Task subclass's cancelling() runs
 * in between).  Python code that runs on the way may reschedule the Timeout
 * (its state is entered by then, as in asyncio): the arming replaces that
 * expiry, for the deadline that reschedule set, as asyncio's does. */
int ext_timeout_enter(TimeoutObject *self, PyObject *loop, int64_t now_ns) {
    ext_state *st = self->st;
    if (self->state != T_CREATED) {
        PyErr_SetString(PyExc_RuntimeError, "Timeout has already been entered");
        return -1;
    }
    PyObject *task = ext_current_task(&st->compat, loop);
    if (!task) return -1;
    if (task == Py_None) {
        Py_DECREF(task);
        PyErr_SetString(PyExc_RuntimeError, "Timeout should be used inside a task");
        return -1;
    }
    self->state = T_ENTERED;
    Py_XSETREF(self->task, task);
    if (Py_TYPE(task) != st->task_type) now_ns = -1;
    PyObject *c = task_cancelling(st, task);
    if (!c) return -1;
    self->cancelling = PyLong_AsLong(c);
    Py_DECREF(c);
    if (self->cancelling == -1 && PyErr_Occurred()) return -1;
    return timeout_arm(self, loop, now_ns);
}

/* ---- exiting ------------------------------------------------------------------ */

/* raise TimeoutError from exc, inside the handling of exc */
static int raise_timeout_from(PyObject *exc) {
    PyObject *te = PyObject_CallNoArgs(PyExc_TimeoutError);
    if (!te) return -1;
    if (exc && exc != Py_None) {
        PyException_SetCause(te, Py_NewRef(exc));
        PyException_SetContext(te, Py_NewRef(exc));
    }
    PyErr_SetRaisedException(te);
    return -1;
}

#if PY_VERSION_HEX >= 0x030D0000
/* The first CancelledError in exc's context chain gets a TimeoutError put
 * in front of it (asyncio's Timeout._insert_timeout_error, 3.13). */
static int insert_timeout_error(ext_state *st, PyObject *exc) {
    Py_INCREF(exc);
    PyObject *ctx;
    while ((ctx = PyException_GetContext(exc)) != NULL) {
        int cancelled = PyObject_IsInstance(ctx, st->CancelledError);
        if (cancelled) {
            PyObject *te = cancelled > 0 ? PyObject_CallNoArgs(PyExc_TimeoutError) : NULL;
            if (te) {
                PyException_SetContext(te, Py_NewRef(ctx));
                PyException_SetCause(te, Py_NewRef(ctx));
                PyException_SetContext(exc, te);
            }
            Py_DECREF(ctx);
            Py_DECREF(exc);
            return te ? 0 : -1;
        }
        Py_SETREF(exc, ctx);
    }
    Py_DECREF(exc);
    return 0;
}

/* insert_timeout_error() on each exception of an ExceptionGroup. */
static int insert_timeout_error_each(ext_state *st, PyObject *group) {
    PyObject *excs = PyObject_GetAttr(group, st->str_exceptions);
    if (!excs) return -1;
    PyObject *it = PyObject_GetIter(excs);
    Py_DECREF(excs);
    if (!it) return -1;
    PyObject *e;
    int rc = 0;
    while (rc == 0 && (e = PyIter_Next(it)) != NULL) {
        rc = insert_timeout_error(st, e);
        Py_DECREF(e);
    }
    Py_DECREF(it);
    return rc < 0 || PyErr_Occurred() ? -1 : 0;
}
#endif

/* The exit of an expired Timeout whose cancellation nobody else asked for:
 * the CancelledError it caused becomes TimeoutError. */
static int expired_exit(ext_state *st, PyObject *exc_type, PyObject *exc_val) {
#if PY_VERSION_HEX >= 0x030D0000
    int sub = PyObject_IsSubclass(exc_type, st->CancelledError);
    if (sub < 0) return -1;
    if (sub) return raise_timeout_from(exc_val);
    if (exc_val == Py_None) return 0;
    if (insert_timeout_error(st, exc_val) < 0) return -1;
    int group = PyObject_IsInstance(exc_val, st->ExceptionGroup);
    if (group <= 0) return group;
    return insert_timeout_error_each(st, exc_val);
#else
    if (exc_type == st->CancelledError) return raise_timeout_from(exc_val);
    return 0;
#endif
}

/* What __aexit__ does. */
int ext_timeout_exit(TimeoutObject *self, PyObject *exc_type, PyObject *exc_val) {
    ext_state *st = self->st;
    if (self->state != T_ENTERED && self->state != T_EXPIRING) {
        PyErr_Format(PyExc_AssertionError, "__aexit__ of a %s Timeout",
                     timeout_state_names[self->state]);
        return -1;
    }
    ext_forget_stop_iteration(&st->compat, (PyObject *)self);
    /* The disarm may run Python code (a stand-in handle's cancel()) that
     * reschedules or exits this Timeout: the state is read after it, as
     * asyncio reads it, and a reschedule made then is undone once the
     * state is final (no later one can arm). */
    if (timeout_disarm(self) < 0) return -1;
    if (self->state == T_ENTERED) {
        self->state = T_EXITED;
        return timeout_disarm(self);
    }
    if (self->state != T_EXPIRING || !self->task) return 0; /* exited meanwhile */
    self->state = T_EXPIRED;
    PyObject *task = Py_NewRef(self->task);
    PyObject *n = PyObject_CallMethodNoArgs(task, st->str_uncancel);
    Py_DECREF(task);
    if (!n) return -1;
    long left = PyLong_AsLong(n);
    Py_DECREF(n);
    if (left == -1 && PyErr_Occurred()) return -1;
    if (left > self->cancelling || exc_type == Py_None) return 0;
    return expired_exit(st, exc_type, exc_val);
}

/* ---- Step: what __aenter__ and __aexit__ return -------------------------------
 * asyncio's __aenter__ and __aexit__ are coroutines: calling one does
 * nothing until it is driven.  A Step is such a coroutine for one Timeout:
 * the first send() enters or exits the Timeout and ends, so an `await`
 * never suspends; closed or thrown into before that, it never runs. */

enum { STEP_ENTER, STEP_EXIT, STEP_DONE };

typedef struct {
    PyObject_HEAD
    ext_state *st;
    int op;
    TimeoutObject *timeout;       /* until the step ran */
    PyObject *exc_type, *exc_val; /* __aexit__'s arguments */
} StepObject;
#define STEP_REFS(X) X(timeout) X(exc_type) X(exc_val)

static PyObject *step_new(TimeoutObject *t, int op, PyObject *exc_type, PyObject *exc_val) {
    ext_state *st = t->st;
    StepObject *s = (StepObject *)ext_freelist_take(&st->steps, st->Step_Type);
    if (!s && !(s = PyObject_GC_New(StepObject, st->Step_Type))) return NULL;
    s->st = st;
    s->op = op;
    s->timeout = (TimeoutObject *)Py_NewRef(t);
    s->exc_type = Py_XNewRef(exc_type);
    s->exc_val = Py_XNewRef(exc_val);
    PyObject_GC_Track(s);
    return (PyObject *)s;
}

EXT_GC_TRAVERSE(Step, StepObject, STEP_REFS)

static int Step_clear(StepObject *self) {
    self->op = STEP_DONE;
    STEP_REFS(EXT_CLEAR_REF)
    return 0;
}

static void Step_dealloc(StepObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Step_clear(self);
    ext_state *st = ext_state_alive(tp);
    if (st && tp == st->Step_Type && ext_freelist_put(&st->steps, (PyObject *)self)) return;
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Runs the step: 0 with *result set (a new reference), or -1. */
static int step_run(StepObject *self, PyObject *arg, PyObject **result) {
    *result = NULL;
    if (self->op == STEP_DONE) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return -1;
    }
    if (arg != Py_None) {
        PyErr_SetString(PyExc_TypeError, "can't send non-None value to a just-started coroutine");
        return -1;
    }
    /* The step's references are taken over: it is done before it runs, so
     * a reentrant send() finds it spent. */
    TimeoutObject *t = self->timeout;
    PyObject *exc_type = self->exc_type, *exc_val = self->exc_val;
    int op = self->op, rc;
    self->op = STEP_DONE;
    self->timeout = NULL;
    self->exc_type = self->exc_val = NULL;
    if (op == STEP_ENTER) {
        PyObject *loop = ext_need_running_loop(t->st);
        rc = loop ? ext_timeout_enter(t, loop, -1) : -1;
        Py_XDECREF(loop);
    } else {
        rc = ext_timeout_exit(t, exc_type, exc_val);
        Py_DECREF(exc_type);
        Py_DECREF(exc_val);
    }
    if (rc == 0) *result = Py_NewRef(op == STEP_ENTER ? (PyObject *)t : Py_None);
    Py_DECREF(t);
    return rc;
}

static PySendResult Step_am_send(StepObject *self, PyObject *arg, PyObject **result) {
    return step_run(self, arg, result) == 0 ? PYGEN_RETURN : PYGEN_ERROR;
}

/* The end of a step as a call's: StopIteration(result), or none for None
 * where the caller takes "exhausted" to mean that. */
static PyObject *step_stop(StepObject *self, PyObject *arg, int bare_none) {
    PyObject *result;
    if (step_run(self, arg, &result) < 0) return NULL;
    if (result == Py_None) {
        Py_DECREF(result);
        if (!bare_none) PyErr_SetNone(PyExc_StopIteration);
        return NULL;
    }
    ext_raise_stop_iteration(&self->st->compat, result);
    Py_DECREF(result);
    return NULL;
}

static PyObject *Step_iternext(StepObject *self) { return step_stop(self, Py_None, 1); }

static PyObject *Step_send(StepObject *self, PyObject *arg) { return step_stop(self, arg, 0); }

/* An instance of the exception class `typ` for `value` (an instance
 * already, None, a tuple of arguments or the one argument), as CPython
 * normalizes one (errors.c, _PyErr_CreateException), but without chaining
 * the exception being handled as PyErr_SetObject would. */
static PyObject *exception_of_class(PyObject *typ, PyObject *value) {
    if (PyExceptionInstance_Check(value) && PyObject_IsInstance(value, typ) > 0)
        return Py_NewRef(value);
    if (PyErr_Occurred()) return NULL;
    PyObject *exc = value == Py_None      ? PyObject_CallNoArgs(typ)
                    : PyTuple_Check(value) ? PyObject_Call(typ, value, NULL)
                                           : PyObject_CallOneArg(typ, value);
    if (exc && !PyExceptionInstance_Check(exc)) {
        PyErr_Format(PyExc_TypeError,
                     "calling %R should have returned an instance of BaseException, not %s",
                     typ, Py_TYPE(exc)->tp_name);
        Py_CLEAR(exc);
    }
    return exc;
}

/* The exception a coroutine's throw(exc) or throw(type[, value[, tb]]) is
 * asked to raise, checked as generators check it; NULL with an error set. */
PyObject *ext_throw_args_exception(PyObject *const *args, Py_ssize_t nargs) {
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
        /* made as a generator's throw() makes it: raised where the
         * coroutine waits, not chained to what the caller is handling */
        PyObject *exc = exception_of_class(typ, val);
        if (!exc) return NULL;
        PyErr_SetRaisedException(exc);
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

/* throw() before the step ran: it never will, and the exception is raised
 * here, as from a coroutine thrown into before its first line. */
static PyObject *Step_throw(StepObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *exc = ext_throw_args_exception(args, nargs);
    if (!exc) return NULL;
    Step_clear(self);
    PyErr_SetRaisedException(exc);
    return NULL;
}

static PyObject *Step_close(StepObject *self, PyObject *Py_UNUSED(ignored)) {
    Step_clear(self);
    Py_RETURN_NONE;
}

static PyObject *Step_await(StepObject *self) { return Py_NewRef(self); }

static PyMethodDef Step_methods[] = {
    {"send", (PyCFunction)Step_send, METH_O, NULL},
    {"throw", (PyCFunction)(void (*)(void))Step_throw, METH_FASTCALL, NULL},
    {"close", (PyCFunction)Step_close, METH_NOARGS, NULL},
    {NULL}};

static PyType_Slot Step_slots[] = {
    {Py_tp_doc, "What Timeout.__aenter__() and __aexit__() return: a coroutine that runs "
                "its step when first driven, without suspending."},
    {Py_tp_dealloc, Step_dealloc},
    {Py_tp_traverse, Step_traverse},
    {Py_tp_clear, Step_clear},
    {Py_am_await, Step_await},
    {Py_am_send, Step_am_send},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, Step_iternext},
    {Py_tp_methods, Step_methods},
    {0, NULL}};

PyType_Spec Step_spec = {
    .name = "bucketimer._core._TimeoutStep",
    .basicsize = sizeof(StepObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Step_slots,
};

/* ---- the Timeout's methods ---------------------------------------------------- */

static PyObject *Timeout_aenter(TimeoutObject *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *s = step_new(self, STEP_ENTER, NULL, NULL);
#ifndef Py_GIL_DISABLED
    if (s) Py_XSETREF(self->step, Py_NewRef(s));
#endif
    return s;
}

/* The Step __aenter__ returned, made an exit step again, if it ran and
 * nobody but this Timeout holds it (so nobody can tell it is the same
 * object): a second Step, and its allocation, spared per `async with`. */
static PyObject *reuse_step(TimeoutObject *self, PyObject *exc_type, PyObject *exc_val) {
    StepObject *s = (StepObject *)self->step;
    if (!s || Py_REFCNT(s) != 1 || s->op != STEP_DONE) return NULL;
    s->op = STEP_EXIT;
    s->timeout = (TimeoutObject *)Py_NewRef(self);
    s->exc_type = Py_NewRef(exc_type);
    s->exc_val = Py_NewRef(exc_val);
    self->step = NULL; /* the caller's reference now; the step holds self */
    return (PyObject *)s;
}

static PyObject *Timeout_aexit(TimeoutObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__aexit__ takes exc_type, exc_val, exc_tb");
        return NULL;
    }
    PyObject *s = reuse_step(self, args[0], args[1]);
    return s ? s : step_new(self, STEP_EXIT, args[0], args[1]);
}

static PyObject *Timeout_when(TimeoutObject *self, PyObject *Py_UNUSED(ignored)) {
    return Py_NewRef(self->when ? self->when : Py_None); /* (NULL: cleared by the GC) */
}

static PyObject *Timeout_expired(TimeoutObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(self->state == T_EXPIRING || self->state == T_EXPIRED);
}

/* asyncio's f"<Timeout [{state}] when={round(when, 3)}>": the rounding and
 * the formatting may run Python code (the deadline's), which may change the
 * state; the state is read after them, as the f-string reads it. */
static PyObject *Timeout_repr(TimeoutObject *self) {
    if (self->state != T_ENTERED || !self->when)
        return PyUnicode_FromFormat("<Timeout [%s]>", timeout_state_names[self->state]);
    PyObject *when = Py_NewRef(self->when);
    PyObject *w = when == Py_None ? Py_NewRef(Py_None)
                                  : PyObject_CallMethod(when, "__round__", "i", 3);
    Py_DECREF(when);
    PyObject *text = w ? PyObject_Format(w, NULL) : NULL;
    Py_XDECREF(w);
    if (!text) return NULL;
    PyObject *r = PyUnicode_FromFormat("<Timeout [%s] when=%U>", timeout_state_names[self->state],
                                       text);
    Py_DECREF(text);
    return r;
}

static PyMethodDef Timeout_methods[] = {
    {"__aenter__", (PyCFunction)Timeout_aenter, METH_NOARGS, "__aenter__($self, /)\n--\n\n"},
    {"__aexit__", (PyCFunction)(void (*)(void))Timeout_aexit, METH_FASTCALL,
     "__aexit__($self, exc_type, exc_val, exc_tb, /)\n--\n\n"},
    {"when", (PyCFunction)Timeout_when, METH_NOARGS,
     "when($self, /)\n--\n\nReturn the current deadline."},
    {"reschedule", (PyCFunction)(void (*)(void))Timeout_reschedule, METH_FASTCALL | METH_KEYWORDS,
     "reschedule($self, /, when)\n--\n\nReschedule the timeout (None: never)."},
    {"expired", (PyCFunction)Timeout_expired, METH_NOARGS,
     "expired($self, /)\n--\n\nIs timeout expired during execution?"},
    {NULL}};

static PyMemberDef Timeout_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(TimeoutObject, weakreflist), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot Timeout_slots[] = {
    {Py_tp_doc,
     "Timeout(when)\n--\n\nAsynchronous context manager for cancelling overdue code: "
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

/* ---- timeout() and timeout_at() ---------------------------------------------- */

/* timeout(delay) on the running `loop`: a Timeout due at loop.time() +
 * delay.  *now_ns gets the stock clock's reading if that is what was read,
 * else -1. */
PyObject *ext_timeout_on_loop(ext_state *st, PyObject *loop, PyObject *delay, int64_t *now_ns) {
    PyObject *when = NULL;
    int kind;
    *now_ns = -1;
    if (delay == Py_None) {
        when = Py_NewRef(Py_None);
    } else if ((kind = ext_loop_clock(st, loop)) < 0) {
        /* error set */
    } else if (kind == EXT_CLOCK_STOCK && (PyFloat_CheckExact(delay) || PyLong_CheckExact(delay))) {
        /* the float addition `loop.time() + delay` does, without making
         * loop.time()'s float (an int too large for a double raises the
         * same OverflowError there) */
        double d = PyFloat_CheckExact(delay) ? PyFloat_AS_DOUBLE(delay) : PyLong_AsDouble(delay);
        if (!(d == -1.0 && PyErr_Occurred())) {
            *now_ns = bt_now_ns();
            when = PyFloat_FromDouble((double)*now_ns / 1e9 + d);
        }
    } else {
        PyObject *now = loop_time(st, loop, kind);
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

PyObject *ext_timeout(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *delay;
    if (ext_one_arg(args, nargs, kwnames, "timeout", "delay", &delay) < 0) return NULL;
    ext_state *st = ext_state_of_module(m);
    PyObject *loop = ext_need_running_loop(st);
    if (!loop) return NULL;
    int64_t now_ns;
    PyObject *t = ext_timeout_on_loop(st, loop, delay, &now_ns);
    Py_DECREF(loop);
    return t;
}

PyObject *ext_timeout_at(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames) {
    PyObject *when;
    if (ext_one_arg(args, nargs, kwnames, "timeout_at", "when", &when) < 0) return NULL;
    return timeout_make(ext_state_of_module(m), when);
}
