/*
 * slurm_recovery.c - the --recovery[=SPEC] job directive, as a SPANK plugin.
 *
 * On the submit host (sbatch, salloc, srun) the directive is checked with the
 * rules of slurm_hooks/spec.py; a bad one is refused and nothing is queued.
 * In slurmstepd its canonical form goes into the job environment as
 * SLURM_RECOVERY. Jobs without --recovery are left alone.
 *
 * Plugstack arguments:
 *   default_env=NAME              environment of a spec that names none
 *   default_mode=monitor|action   mode of a spec that names none
 *   allowed_envs=a,b,c            refuse any other environment
 *
 * Seen live on Slurm 22.05.8. Prolog/epilog environment, the raw user text:
 *   --recovery              SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery=(null)
 *   --recovery=             SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery=
 *   --recovery=prod:action  SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery=prod:action
 * The job itself gets the same value as SLURM_SPANK__SLURM_SPANK_OPTION_...,
 * and Slurm prints its own "Invalid --recovery argument: X" after our error.
 *
 * Nested submissions. sbatch, salloc and srun read an option from that same
 * variable when the command line lacks it (spank_process_env_options in
 * Slurm's src/common/spank.c), so an sbatch run inside an opted-in job would
 * be opted in too, in the outer job's mode. Inside a job (SLURM_JOB_ID set)
 * sbatch and salloc therefore drop the inherited value before Slurm reads its
 * options: the new job is opted in only by its own --recovery. srun inside a
 * job starts a step of that same job, which keeps it.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/spank.h>

SPANK_PLUGIN(slurm_recovery, 1);

#define TAG "slurm-recovery: "
#define JOB_ENV "SLURM_RECOVERY"
/* where Slurm leaves the raw option in the job environment */
#define OPTION_ENV "SLURM_SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery"
#define MAX_SPEC 512
#define MAX_ENV 64
#define MAX_CKPT 256
#define MAX_URL 400
#define SHOW_MAX 40

static const char *const KEYS[] = { "max-restarts", "hang", "ckpt", "notify", "ckpt-signal",
				    "proactive" };
/* ckpt-signal's values; "B:" before a signal sends it to the batch shell only */
static const char *const CKPT_SIGNALS[] = { "USR1", "USR2", "TERM" };
#define NKEYS (sizeof(KEYS) / sizeof(KEYS[0]))

/* What the plugstack line says. */
static struct {
	char default_env[MAX_ENV + 1];
	const char *default_mode;	/* NULL: the environment's own mode */
	char allowed[MAX_SPEC + 1];	/* comma list; empty: any */
} cfg = { "default", NULL, "" };

/* One parsed directive; -1 / "" mean "not given". */
struct spec {
	char env[MAX_ENV + 1];
	const char *mode;
	long restarts;
	long long hang;
	char ckpt[MAX_SPEC + 1];
	char notify[MAX_SPEC + 1];
	char ckpt_signal[8];	/* "" not given, "none", "USR1", "B:USR1", ... */
	int proactive;		/* -1 not given, 0 no, 1 yes */
};

static char err_msg[256];	/* why the last parse failed */
static char exported[2 * MAX_SPEC];	/* canonical spec of this job, if any */
static char inherited_from[32];	/* the enclosing job whose opt-in was dropped */

__attribute__((format(printf, 1, 2))) static int refuse(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(err_msg, sizeof(err_msg), fmt, ap);
	va_end(ap);
	return -1;
}

/* A bad part, quoted and cut short the way spec.py's _show does. */
static const char *show(const char *s, size_t len)
{
	static char out[2 * SHOW_MAX + 8];
	size_t keep = len > SHOW_MAX ? SHOW_MAX - 3 : len, o = 0;
	char q = (memchr(s, '\'', keep) && !memchr(s, '"', keep)) ? '"' : '\'';

	out[o++] = q;
	for (size_t i = 0; i < keep; i++) {
		if (s[i] == '\\' || s[i] == q)
			out[o++] = '\\';
		out[o++] = s[i];
	}
	if (keep < len)
		o += (size_t)sprintf(out + o, "...");
	out[o++] = q;
	out[o] = '\0';
	return out;
}

static int is_alnum(int c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
	       (c >= '0' && c <= '9');
}

/* 1 when every one of the len bytes is alphanumeric or in extra. */
static int all_in(const char *s, size_t len, const char *extra)
{
	for (size_t i = 0; i < len; i++)
		if (!is_alnum((unsigned char)s[i]) && !(s[i] && strchr(extra, s[i])))
			return 0;
	return 1;
}

static int valid_env(const char *s)
{
	size_t len = strlen(s);

	return len >= 1 && len <= MAX_ENV && all_in(s, len, "_-");
}

/* Length in characters (UTF-8), then only printable ASCII but space. */
static int check_text(const char *text)
{
	size_t chars = 0, len;
	const unsigned char *p;

	for (p = (const unsigned char *)text; *p; p++)
		chars += (*p & 0xC0) != 0x80;
	if (chars > MAX_SPEC)
		return refuse("spec is %zu characters long (at most %d)", chars, MAX_SPEC);
	for (p = (const unsigned char *)text; *p; p++) {
		if (*p > ' ' && *p <= '~')
			continue;
		if (*p == ' ')
			return refuse("invalid character ' ' in spec");
		if (*p == '\t' || *p == '\n' || *p == '\r')
			return refuse("invalid character '\\%c' in spec",
				      *p == '\t' ? 't' : *p == '\n' ? 'n' : 'r');
		if (*p < 0xC0)
			return refuse("invalid character '\\x%02x' in spec", *p);
		for (len = 1; (p[len] & 0xC0) == 0x80; len++)
			;
		return refuse("invalid character '%.*s' in spec", (int)len, (const char *)p);
	}
	return 0;
}

static int parse_head(char *head, struct spec *sp)
{
	char *colon = strchr(head, ':');
	const char *mode = colon ? colon + 1 : NULL;

	if (colon)
		*colon = '\0';
	if (mode && !*mode)
		return refuse("empty mode after ':' (expected monitor or action)");
	if (*head && !valid_env(head))
		return refuse("invalid environment %s (letters, digits, _ and -, at most 64)",
			      show(head, strlen(head)));
	if (mode && strcmp(mode, "monitor") && strcmp(mode, "action"))
		return refuse("invalid mode %s (expected monitor or action)",
			      show(mode, strlen(mode)));
	snprintf(sp->env, sizeof(sp->env), "%s", *head ? head : cfg.default_env);
	if (mode)
		sp->mode = strcmp(mode, "monitor") ? "action" : "monitor";
	return 0;
}

/*
 * A run of 1-8 digits at *p as a number (advancing *p); -1 when there is none.
 * Eight digits keep every sum below far within a long long.
 */
static long long take_number(const char **p)
{
	size_t digits = strspn(*p, "0123456789");
	long long n = 0;

	if (digits < 1 || digits > 8)
		return -1;
	for (size_t i = 0; i < digits; i++)
		n = n * 10 + ((*p)[i] - '0');
	*p += digits;
	return n;
}

/*
 * Slurm's clock forms, as time_str2secs reads them (fields not range-checked):
 * SS (a bare number is seconds here, see durations.py), MM:SS, HH:MM:SS, D-HH,
 * D-HH:MM, D-HH:MM:SS. -1 when v is not one of them.
 */
static long long clock_seconds(const char *v)
{
	static const long long weights[3][3] = { { 1 }, { 60, 1 }, { 3600, 60, 1 } };
	long long days = -1, field[3], total = 0;
	const char *p = v;
	int n = 0;

	if (strchr(v, '-')) {
		if ((days = take_number(&p)) < 0 || *p++ != '-')
			return -1;
	}
	for (;;) {
		if (n == 3 || (field[n++] = take_number(&p)) < 0)
			return -1;
		if (!*p)
			break;
		if (*p++ != ':')
			return -1;
	}
	for (int i = 0; i < n; i++)
		total += field[i] * (days >= 0 ? weights[2][i] : weights[n - 1][i]);
	return total + (days > 0 ? days * 86400 : 0);
}

/* 1h30m, 2d4h, 90s: units d, h, m, s, largest first, each at most once. */
static long long unit_seconds(const char *v)
{
	static const char units[] = "dhms";
	static const long long secs[] = { 86400, 3600, 60, 1 };
	const char *p = v, *unit, *last = NULL;
	long long n, total = 0;

	while (*p) {
		if ((n = take_number(&p)) < 0 || !*p || !(unit = strchr(units, *p)))
			return -1;
		if (last && unit <= last)
			return -1;
		total += n * secs[unit - units];
		last = unit;
		p++;
	}
	return last ? total : -1;
}

/* The rules of slurm_hooks/durations.py; -1 when v is no duration. */
static long long parse_duration(const char *v)
{
	size_t len = strlen(v);

	if (len && strspn(v, "0123456789-:") == len)
		return clock_seconds(v);
	return unit_seconds(v);
}

#define MAX_HANG (365LL * 86400)	/* spec.py's MAX_HANG */

static int parse_hang(const char *v, struct spec *sp)
{
	long long secs = parse_duration(v);

	if (secs < 1 || secs > MAX_HANG)
		return refuse("invalid hang %s (a duration such as 90s, 20m, 1h30m, 01:30:00; "
			      "at most 365d)", show(v, strlen(v)));
	sp->hang = secs;
	return 0;
}

static int parse_ckpt(const char *v, struct spec *sp)
{
	size_t len = strlen(v);

	if (v[0] != '/')
		return refuse("invalid ckpt %s (an absolute path)", show(v, len));
	if (len > MAX_CKPT || !all_in(v, len, "_./@+*?{}[]-"))
		return refuse("invalid ckpt %s (path has a character outside letters, "
			      "digits and _ . / @ + * ? { } [ ] -)", show(v, len));
	snprintf(sp->ckpt, sizeof(sp->ckpt), "%s", v);
	return 0;
}

static int parse_notify(const char *v, struct spec *sp)
{
	size_t skip = !strncmp(v, "https://", 8) ? 8 : !strncmp(v, "http://", 7) ? 7 : 0;
	size_t rest = strlen(v) - skip;
	int ok = !strcmp(v, "none") || !strcmp(v, "mail") ||
		 (skip && rest >= 1 && rest <= MAX_URL && all_in(v + skip, rest, "._~:/?#@!*+=%-"));

	if (!ok)
		return refuse("invalid notify %s (none, mail, or an http(s) URL)",
			      show(v, strlen(v)));
	snprintf(sp->notify, sizeof(sp->notify), "%s", v);
	return 0;
}

static int parse_ckpt_signal(const char *v, struct spec *sp)
{
	const char *sig = !strncmp(v, "B:", 2) ? v + 2 : v;
	int ok = !strcmp(v, "none");

	for (size_t i = 0; !ok && i < sizeof(CKPT_SIGNALS) / sizeof(CKPT_SIGNALS[0]); i++)
		ok = !strcmp(sig, CKPT_SIGNALS[i]);
	if (!ok)
		return refuse("invalid ckpt-signal %s (USR1, USR2, TERM, each optionally B: "
			      "for the batch shell only, or none)", show(v, strlen(v)));
	snprintf(sp->ckpt_signal, sizeof(sp->ckpt_signal), "%s", v);
	return 0;
}

static int parse_proactive(const char *v, struct spec *sp)
{
	if (strcmp(v, "yes") && strcmp(v, "no"))
		return refuse("invalid proactive %s (yes or no)", show(v, strlen(v)));
	sp->proactive = !strcmp(v, "yes");
	return 0;
}

static int parse_value(size_t key, const char *v, struct spec *sp)
{
	if (!*v)
		return refuse("empty value for %s", KEYS[key]);
	switch (key) {
	case 0:
		if (strlen(v) > 4 || strspn(v, "0123456789") != strlen(v) ||
		    strtol(v, NULL, 10) > 1000)
			return refuse("invalid max-restarts %s (an integer 0-1000)",
				      show(v, strlen(v)));
		sp->restarts = strtol(v, NULL, 10);
		return 0;
	case 1:
		return parse_hang(v, sp);
	case 2:
		return parse_ckpt(v, sp);
	case 3:
		return parse_notify(v, sp);
	case 4:
		return parse_ckpt_signal(v, sp);
	default:
		return parse_proactive(v, sp);
	}
}

/* One "key=value" part after the head; seen[] catches repeats. */
static int parse_pair(char *part, int seen[NKEYS], struct spec *sp)
{
	char *eq = strchr(part, '=');
	size_t key;

	if (!eq)
		return refuse("expected key=value, got %s", show(part, strlen(part)));
	*eq = '\0';
	for (key = 0; key < NKEYS && strcmp(part, KEYS[key]); key++)
		;
	if (key == NKEYS)
		return refuse("unknown key %s (known: max-restarts, hang, ckpt, notify, "
			      "ckpt-signal, proactive)",
			      show(part, strlen(part)));
	if (seen[key]++)
		return refuse("key '%s' given twice", KEYS[key]);
	return parse_value(key, eq + 1, sp);
}

/* The whole directive, as spec.py's parse(); NULL or "(null)" is bare. */
static int parse_spec(const char *text, struct spec *sp)
{
	char buf[MAX_SPEC + 1], *part, *next;
	int seen[NKEYS] = { 0 };
	size_t len;

	memset(sp, 0, sizeof(*sp));
	sp->restarts = sp->hang = -1;
	sp->proactive = -1;
	sp->mode = cfg.default_mode;
	snprintf(sp->env, sizeof(sp->env), "%s", cfg.default_env);
	if (!text || !strcmp(text, "(null)") || !*text)
		return 0;
	if (check_text(text) < 0)
		return -1;
	len = strlen(text);
	if (text[0] == ',' || text[len - 1] == ',' || strstr(text, ",,"))
		return refuse("empty part in spec (check for doubled or trailing commas)");
	memcpy(buf, text, len + 1);
	next = strchr(buf, ',');
	if (next)
		*next++ = '\0';
	if (!strchr(buf, '=')) {
		if (parse_head(buf, sp) < 0)
			return -1;
		part = next;
	} else {
		part = buf;
		if (next)
			next[-1] = ',';
	}
	for (; part; part = next) {
		next = strchr(part, ',');
		if (next)
			*next++ = '\0';
		if (parse_pair(part, seen, sp) < 0)
			return -1;
	}
	return 0;
}

/* When allowed_envs is set, the spec's environment must be one of them. */
static int check_allowed(const char *env)
{
	char shown[2 * MAX_SPEC + 1];
	const char *p = cfg.allowed;
	size_t n, o = 0;

	if (!*p)
		return 0;
	for (; *p; p += n + (p[n] == ',')) {
		n = strcspn(p, ",");
		if (n == strlen(env) && !strncmp(p, env, n))
			return 0;
		o += (size_t)snprintf(shown + o, sizeof(shown) - o, "%s%.*s",
				      o ? ", " : "", (int)n, p);
	}
	return refuse("environment '%s' is not allowed (allowed: %s)", env, shown);
}

/* env[:mode][,max-restarts=N][,hang=Ns][,ckpt=..][,notify=..][,ckpt-signal=..][,proactive=..] */
static void format_spec(const struct spec *sp, char *out, size_t size)
{
	size_t o = (size_t)snprintf(out, size, "%s%s%s", sp->env,
				    sp->mode ? ":" : "", sp->mode ? sp->mode : "");

	if (sp->restarts >= 0)
		o += (size_t)snprintf(out + o, size - o, ",max-restarts=%ld", sp->restarts);
	if (sp->hang >= 0)
		o += (size_t)snprintf(out + o, size - o, ",hang=%llds", sp->hang);
	if (*sp->ckpt)
		o += (size_t)snprintf(out + o, size - o, ",ckpt=%s", sp->ckpt);
	if (*sp->notify)
		o += (size_t)snprintf(out + o, size - o, ",notify=%s", sp->notify);
	if (*sp->ckpt_signal)
		o += (size_t)snprintf(out + o, size - o, ",ckpt-signal=%s", sp->ckpt_signal);
	if (sp->proactive >= 0)
		snprintf(out + o, size - o, ",proactive=%s", sp->proactive ? "yes" : "no");
}

/*
 * The option callback. On the submit host a bad spec fails the command
 * (-1). In slurmstepd the spec was already accepted at submission, so a
 * failure here only means the node's plugstack differs: log it and run
 * the job without SLURM_RECOVERY rather than kill it.
 */
static int recovery_option(int val, const char *optarg, int remote)
{
	struct spec sp;

	(void)val;
	exported[0] = '\0';
	if (parse_spec(optarg, &sp) < 0 || check_allowed(sp.env) < 0) {
		slurm_error(TAG "--recovery: %s", err_msg);
		return remote ? 0 : -1;
	}
	format_spec(&sp, exported, sizeof(exported));
	return 0;
}

static struct spank_option recovery_opt = {
	"recovery", "SPEC",
	"Recover this job automatically: [ENV][:monitor|:action][,max-restarts=N]"
	"[,hang=DURATION][,ckpt=PATH][,notify=none|mail|URL]"
	"[,ckpt-signal=[B:]USR1|USR2|TERM|none][,proactive=yes|no]",
	2, 0, recovery_option
};

/* A bad argument is logged and ignored: see slurm_spank_init. */
static void read_arg(const char *arg, int loud)
{
	void (*say)(const char *, ...) = loud ? slurm_error : slurm_verbose;
	const char *v = strchr(arg, '=') ? strchr(arg, '=') + 1 : "";

	if (!strncmp(arg, "default_env=", 12)) {
		if (valid_env(v))
			snprintf(cfg.default_env, sizeof(cfg.default_env), "%s", v);
		else
			say(TAG "init: invalid default_env '%s' (ignored)", v);
	} else if (!strncmp(arg, "default_mode=", 13)) {
		if (!strcmp(v, "monitor") || !strcmp(v, "action"))
			cfg.default_mode = strcmp(v, "monitor") ? "action" : "monitor";
		else
			say(TAG "init: invalid default_mode '%s' (ignored)", v);
	} else if (!strncmp(arg, "allowed_envs=", 13)) {
		if (strlen(v) <= MAX_SPEC)
			snprintf(cfg.allowed, sizeof(cfg.allowed), "%s", v);
		else
			say(TAG "init: allowed_envs is too long (ignored)");
	} else {
		say(TAG "init: unknown plugstack argument '%s'", arg);
	}
}

/*
 * sbatch or salloc inside a job: the job's own opt-in (and its normal form)
 * is in the environment this command inherited. It describes the enclosing
 * job, not the one being submitted, so it goes before Slurm reads options.
 */
static void drop_inherited(void)
{
	const char *job = getenv("SLURM_JOB_ID");

	if (!job)
		job = getenv("SLURM_JOBID");
	if (!job || (!getenv(OPTION_ENV) && !getenv(JOB_ENV)))
		return;
	snprintf(inherited_from, sizeof(inherited_from), "%s", job);
	unsetenv(OPTION_ENV);
	unsetenv(JOB_ENV);
}

/*
 * Plugstack mistakes never fail init: in slurmd that would stop the node
 * from starting any job, including jobs that never asked for recovery.
 * They are logged as errors where the admin looks (slurmd and slurmstepd
 * logs) and only with -v on the submit host, so users see no noise.
 */
int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();
	int loud = ctx != S_CTX_LOCAL && ctx != S_CTX_ALLOCATOR;
	spank_err_t err;

	for (int i = 0; i < ac; i++)
		read_arg(av[i], loud);
	if (ctx == S_CTX_ALLOCATOR)
		drop_inherited();
	switch (ctx) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
	case S_CTX_REMOTE:
		err = spank_option_register(sp, &recovery_opt);
		if (err != ESPANK_SUCCESS) {
			slurm_error(TAG "init: cannot register --recovery: %s",
				    spank_strerror(err));
			return ctx == S_CTX_REMOTE ? 0 : -1;
		}
		return 0;
	default:
		return 0;
	}
}

/*
 * salloc: the shell it starts sees the spec too (job steps get it below).
 * sbatch or salloc inside an opted-in job, without a --recovery of its own:
 * say once, on the submit host, that this job is not opted in.
 */
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_ALLOCATOR)
		return 0;
	if (exported[0] && setenv(JOB_ENV, exported, 1))
		slurm_error(TAG "post_opt: cannot set " JOB_ENV);
	if (!exported[0] && inherited_from[0])
		slurm_info(TAG "job %s's --recovery is not passed on to this job; give it "
			   "--recovery to opt it in", inherited_from);
	return 0;
}

/*
 * In slurmstepd, before the tasks start. Normally the option callback has
 * run by now; for the batch step of `sbatch --export=NONE` 22.05 skips it
 * but still puts the raw option in the job environment, so read it there.
 * A step that did not opt in loses any SLURM_RECOVERY it inherited from the
 * submitting shell: the variable always means "this job asked for recovery".
 */
int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	char raw[4 * MAX_SPEC];
	spank_err_t err;

	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	if (!exported[0]) {
		err = spank_getenv(sp, OPTION_ENV, raw, sizeof(raw));
		if (err == ESPANK_SUCCESS)
			recovery_option(0, raw, 1);
		else if (err == ESPANK_NOSPACE)
			slurm_error(TAG "user_init: --recovery value is too long (ignored)");
	}
	err = exported[0] ? spank_setenv(sp, JOB_ENV, exported, 1) : spank_unsetenv(sp, JOB_ENV);
	if (err != ESPANK_SUCCESS && err != ESPANK_ENV_NOEXIST)
		slurm_error(TAG "user_init: cannot update " JOB_ENV ": %s", spank_strerror(err));
	return 0;
}
