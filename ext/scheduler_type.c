/*
 * scheduler_type.c -- the drop-in loop's call_at/call_later: a callable bound to
 * (TimerThread, loop), set on the loop instance (loop.py), so that
 * loop.call_later(d, cb) is one vectorcall into schedule.c.  Its handles
 * are LoopHandles, with asyncio.TimerHandle's semantics (cancel() returns None).  A
 * Scheduler never changes once made; it is called with the GIL held.  One
 * made for the default TimerThread (_core._scheduler) follows the default,
 * which is made anew once closed.
 */
#include "module.h"

/* ---- Scheduler: loop.call_at / loop.call_later of the drop-in loop --------
 * A callable bound to (TimerThread, loop) so the drop-in loop's call_later
 * is one vectorcall, with asyncio.TimerHandle semantics on its handles. */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    ext_state *st;
    TimerThreadObject *tt; /* NULL: the default TimerThread, whichever it is */
    PyObject *loop;
    int absolute;
} SchedulerObject;
#define SCHEDULER_REFS(X) X(tt) X(loop)

/* The time argument as asyncio's loop takes it (docs/asyncio.rst, "One
 * contract"): None is refused with asyncio's messages; ints (bools too) and
 * floats are taken, an int too large for a float raising call_later's
 * OverflowError (asyncio's `self.time() + delay`) and being +-inf to
 * call_at; anything else is added to the clock's reading for call_later
 * (a Fraction is, a Decimal or a str is not) and must be a real number for
 * call_at.  *absolute says which `*t` is (call_later's sum is a deadline). */
static int loop_time_arg(PyObject *o, int *absolute, double *t) {
    if (o == Py_None) {
        PyErr_SetString(PyExc_TypeError,
                        *absolute ? "when cannot be None" : "delay must not be None");
        return -1;
    }
    if (PyFloat_Check(o)) {
        *t = PyFloat_AS_DOUBLE(o);
        return 0;
    }
    if (PyBool_Check(o)) {
        *t = o == Py_True;
        return 0;
    }
    if (PyLong_Check(o)) {
        if (*absolute) return ext_to_seconds(o, "when", t);
        *t = PyLong_AsDouble(o);
        return *t == -1.0 && PyErr_Occurred() ? -1 : 0;
    }
    if (*absolute) return ext_to_seconds(o, "when", t);
    PyObject *now = PyFloat_FromDouble((double)bt_now_ns() / 1e9);
    PyObject *when = now ? PyNumber_Add(now, o) : NULL;
    Py_XDECREF(now);
    if (!when) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            ext_type_error("delay", "a real number", o);
        }
        return -1;
    }
    int rc = ext_to_seconds(when, "delay", t);
    Py_DECREF(when);
    *absolute = 1;
    return rc;
}

static PyObject *Scheduler_vectorcall(SchedulerObject *self, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *context = NULL;
    if (ext_parse_schedule_args(args, nargs, kwnames, self->absolute, NULL, &context) < 0)
        return NULL;
    /* loop changes only when the GC clears the Scheduler, which it does
     * not while the Scheduler is being called: NULL here, or set
     * throughout the call. */
    if (!self->loop) {
        PyErr_SetString(PyExc_RuntimeError, "this Scheduler was cleared");
        return NULL;
    }
    /* held: scheduling runs Python code, which may replace the default */
    TimerThreadObject *tt = self->tt ? self->tt : ext_default_tt(self->st);
    if (!tt) return NULL;
    Py_INCREF(tt);
    int absolute = self->absolute;
    double t;
    if (ext_check_open(tt) < 0 || loop_time_arg(args[0], &absolute, &t) < 0) {
        Py_DECREF(tt);
        return NULL;
    }
    /* NaN: asyncio's heap runs it at once (`when >= end_time` is false) */
    int nan = isnan(t);
    PyObject *h = ext_schedule(tt, absolute, nan ? -INFINITY : t, args[1], args + 2,
                               nargs - 2, self->loop, context, EXT_SCHED_COMPAT);
    Py_DECREF(tt);
    if (h && nan) ext_handle_when_nan(h);
    else if (h && self->absolute) ext_handle_keep_when(h, args[0]);
    return h;
}

EXT_GC_TRAVERSE(Scheduler, SchedulerObject, SCHEDULER_REFS)
EXT_GC_CLEAR(Scheduler, SchedulerObject, SCHEDULER_REFS)

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

PyType_Spec Scheduler_spec = {
    .name = "bucketimer._core.Scheduler",
    .basicsize = sizeof(SchedulerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = Scheduler_slots,
};

static PyObject *new_scheduler(ext_state *st, TimerThreadObject *tt, PyObject *loop,
                               int absolute) {
    SchedulerObject *o = PyObject_GC_New(SchedulerObject, st->Scheduler_Type);
    if (!o) return NULL;
    o->vectorcall = (vectorcallfunc)Scheduler_vectorcall;
    o->st = st;
    o->tt = (TimerThreadObject *)Py_XNewRef(tt);
    o->loop = Py_NewRef(loop);
    o->absolute = absolute;
    PyObject_GC_Track(o);
    return (PyObject *)o;
}

/* TimerThread._scheduler(loop, absolute): bound to this TimerThread. */
PyObject *ext_TimerThread_scheduler(TimerThreadObject *self, PyObject *args) {
    PyObject *loop;
    int absolute;
    if (!PyArg_ParseTuple(args, "Op:_scheduler", &loop, &absolute)) return NULL;
    if (!self->st) return ext_raise_errno(-EINVAL, "_scheduler");
    return new_scheduler(self->st, self, loop, absolute);
}

/* _core._scheduler(loop, absolute): bound to the default TimerThread,
 * whichever it is when called. */
PyObject *ext_default_scheduler(PyObject *m, PyObject *args) {
    PyObject *loop;
    int absolute;
    if (!PyArg_ParseTuple(args, "Op:_scheduler", &loop, &absolute)) return NULL;
    return new_scheduler(ext_state_of_module(m), NULL, loop, absolute);
}
