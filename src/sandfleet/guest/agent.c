/*
 * sandfleet-agent: the in-sandbox agent, PID 1 of every sandbox.
 *
 * One request per connection. PID 1 only accepts, forks a handler per
 * connection, reaps every child (orphans included) and drains the output
 * pipes of background jobs that outlive their command. Everything that
 * allocates runs in the forked handler, so PID 1 stays a few pages big.
 * Spawned (background) processes each get a supervisor process that owns
 * the process, its pipes and its output; handlers relay to it over a Unix
 * socket in a private run directory.
 * Guest mode (a VM, --vport-fd): connections arrive as channels multiplexed
 * on one virtio-serial port. A mux child process speaks that protocol and
 * passes each channel's socketpair end to PID 1, which serves it exactly like
 * an accepted connection.
 * The wire protocols are documented in protocol.py next to this file.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* A uid no image uses: see main(). */
#define GUARD_UID 2147483646

#define VERSION "0.1.0"
#define MAX_FRAME (4u << 20)  /* argv + env of one exec fit; ARG_MAX is 2 MiB */
#define CHUNK (256u << 10)    /* file data frames */
#define PIPE_READ (64u << 10) /* one read from a command's pipe */
#define MAX_DRAIN 256         /* background pipes PID 1 keeps draining */
#define IDLE_TIMEOUT_S 120    /* a client silent this long mid-request is gone */
#define MAX_FINISHED 64       /* finished spawned processes kept before the oldest go */
#define MAX_PARK 64           /* waiting callers one supervisor serves at once */
#define MAX_GROUPS 256        /* supplementary groups of a user */

extern char **environ;

static volatile sig_atomic_t got_chld, got_alrm, got_term;
static sigset_t wait_mask;  /* mask while sleeping in ppoll: our signals open */
static int handoff[2] = {-1, -1}; /* handler -> PID 1: pipe fds to keep draining */
static const char *sock_path;
static pid_t main_pid; /* ping reports the agent, not the handler */
/* --oom-events: a file with an "oom_kill N" line (memory.events, memory.oom_control) */
static const char *oom_events;
/* Guest mode: the virtio-serial port, and mux -> PID 1 channel ends (SCM_RIGHTS). */
static int vport_fd = -1;
static int chan_sock[2] = {-1, -1};
static pid_t mux_pid; /* PID 1's current mux child, 0 while none runs */
/* Supervisor sockets live here (0700, root); "" if no writable place was found. */
static char run_dir[96];
static int make_run_dir(const char *path);
/* Spawn ids: one counter shared by all handlers through a MAP_SHARED page that
 * PID 1 maps but never touches, so it costs PID 1 no RSS. */
static uint64_t *spawn_ctr;
/* The early OOM killer's kills, in the same page (PID 1 touches it only to
 * count one), so that handlers see them. */
static uint64_t *psi_kills;
static int psi_on; /* the early OOM killer (PID 1, with --oom-events) watches */

/* Big buffers live in BSS: untouched pages cost no RSS, and only handlers touch them. */
static uint8_t req_buf[MAX_FRAME];
static uint8_t data_buf[MAX_FRAME];
static uint8_t io_buf[CHUNK];

static void on_signal(int sig)
{
	if (sig == SIGCHLD) got_chld = 1;
	else if (sig == SIGALRM) got_alrm = 1;
	else got_term = 1;
}

static uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

static void put32(uint8_t *p, uint32_t v)
{
	p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static void put64(uint8_t *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ exec state */

/* The command a handler (or a supervisor) runs; reaping it records its status. */
static pid_t cmd_pid;
static int cmd_done, cmd_status;
static int sock_nonblock; /* exec switches the socket to non-blocking I/O */
static int timed_out;
static uint64_t grace_ms;  /* SIGTERM first, SIGKILL this much later */
static int kill_stage;     /* 0 nothing sent, 1 SIGTERM sent, 2 SIGKILL sent */

static void reap_kids(void)
{
	int st;
	pid_t p;
	got_chld = 0;
	while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
		if (p == cmd_pid && cmd_pid > 0) cmd_done = 1, cmd_status = st;
		if (p == mux_pid && mux_pid > 0) mux_pid = 0; /* serve() starts a new one */
	}
}

struct pp {
	int pid, ppid;
};

static int cmp_pp(const void *a, const void *b)
{
	return ((const struct pp *)a)->pid - ((const struct pp *)b)->pid;
}

static struct pp *find_pp(struct pp *t, size_t n, int pid)
{
	struct pp key = {pid, 0};
	return bsearch(&key, t, n, sizeof *t, cmp_pp);
}

/* Sends `sig` to every process whose parent chain leads to us (one pass over
 * /proc) and returns how many there were, zombies included. As a subreaper we
 * see the whole tree: setsid(), setpgid() and double forks do not leave it. */
static int signal_tree(int sig)
{
	int self = getpid(), found = 0;
	DIR *d = opendir("/proc");
	if (!d) return 0;
	size_t n = 0, cap = 0;
	struct pp *t = NULL;
	struct dirent *de;
	while ((de = readdir(d))) {
		char p[64], buf[512];
		int pid = atoi(de->d_name);
		if (pid <= 0 || pid == self) continue;
		snprintf(p, sizeof p, "/proc/%d/stat", pid);
		int fd = open(p, O_RDONLY | O_CLOEXEC);
		if (fd < 0) continue;
		ssize_t k = read(fd, buf, sizeof buf - 1);
		close(fd);
		if (k <= 0) continue;
		buf[k] = 0;
		/* "pid (comm) S ppid ...": comm may hold ')', so parse after the last one
		 * (by hand: sscanf would pull ~9 kB of scanf code into the binary) */
		char *rp = strrchr(buf, ')'), *end;
		if (!rp || rp[1] != ' ' || !rp[2] || rp[3] != ' ') continue;
		int ppid = (int)strtol(rp + 4, &end, 10);
		if (end == rp + 4) continue;
		if (n == cap) {
			struct pp *nt = realloc(t, (cap = cap ? cap * 2 : 256) * sizeof *t);
			if (!nt) break;
			t = nt;
		}
		t[n++] = (struct pp){pid, ppid};
	}
	closedir(d);
	qsort(t, n, sizeof *t, cmp_pp);
	for (size_t i = 0; i < n; i++) {
		/* walk up the chain; the depth bound guards against a torn snapshot */
		struct pp *e = &t[i];
		for (size_t depth = 0; e && depth <= n; depth++) {
			if (e->ppid == self) {
				kill(t[i].pid, sig);
				found++;
				break;
			}
			e = e->ppid > 1 ? find_pp(t, n, e->ppid) : NULL;
		}
	}
	free(t);
	return found;
}

/* SIGKILLs the whole tree below us until nothing is left (bounded, ~2 s),
 * reaping as we go: orphans of killed processes come back to us. */
static void kill_tree(void)
{
	if (cmd_pid > 0 && !cmd_done) kill(-cmd_pid, SIGKILL);
	for (int round = 0; round < 400; round++) {
		reap_kids();
		if (!signal_tree(SIGKILL)) break;
		usleep(round < 20 ? 1000 : 5000);
	}
	reap_kids();
}

static void arm_timer(uint64_t ms)
{
	struct itimerval it = {{0, 0}, {(time_t)(ms / 1000), (suseconds_t)(ms % 1000) * 1000}};
	if (ms == 0) it.it_value.tv_usec = 1;
	setitimer(ITIMER_REAL, &it, NULL);
}

static void check_timer(void)
{
	if (!got_alrm || cmd_pid <= 0 || cmd_done || kill_stage == 2) return;
	got_alrm = 0;
	timed_out = 1;
	if (kill_stage == 0 && grace_ms) {
		/* a grace period: let it clean up, then SIGKILL at the second alarm */
		kill(-cmd_pid, SIGTERM);
		signal_tree(SIGTERM);
		kill_stage = 1;
		arm_timer(grace_ms);
		return;
	}
	kill_stage = 2;
	kill_tree();
}

static void client_gone(void)
{
	/* Nobody waits for the answer: do not leave the command (or its tree) running. */
	if (cmd_pid > 0 && !cmd_done) kill_tree();
	_exit(0);
}

/* ------------------------------------------------------------------ socket I/O */

static int write_all(int fd, const void *buf, size_t n)
{
	const uint8_t *p = buf;
	while (n) {
		ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
		if (w > 0) {
			p += w;
			n -= (size_t)w;
		} else if (w < 0 && errno == EINTR) {
			continue;
		} else if (w < 0 && errno == EAGAIN && sock_nonblock) {
			struct pollfd pfd = {.fd = fd, .events = POLLOUT};
			ppoll(&pfd, 1, NULL, &wait_mask);
			check_timer();
			if (pfd.revents & (POLLERR | POLLHUP)) return -1;
		} else {
			return -1;
		}
	}
	return 0;
}

static void send_frame(int fd, uint8_t type, const void *payload, size_t n)
{
	uint8_t hdr[5];
	put32(hdr, (uint32_t)n);
	hdr[4] = type;
	if (write_all(fd, hdr, 5) < 0 || (n && write_all(fd, payload, n) < 0)) client_gone();
}

static void send_err(int fd, int err, const char *fmt, ...)
{
	uint8_t msg[4 + 1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf((char *)msg + 4, sizeof msg - 4, fmt, ap);
	va_end(ap);
	if (n < 0) n = 0;
	if ((size_t)n > sizeof msg - 5) n = sizeof msg - 5;
	put32(msg, (uint32_t)err);
	send_frame(fd, 'E', msg, 4 + (size_t)n);
}

/* Blocking read of exactly n bytes; -1 on EOF, error or idle timeout. */
static int read_full(int fd, uint8_t *p, size_t n)
{
	while (n) {
		ssize_t r = read(fd, p, n);
		if (r > 0) {
			p += r;
			n -= (size_t)r;
		} else if (r < 0 && errno == EINTR) {
			continue;
		} else {
			return -1;
		}
	}
	return 0;
}

static int read_frame(int fd, uint8_t *type, uint8_t *buf, uint32_t *len)
{
	uint8_t hdr[5];
	if (read_full(fd, hdr, 5) < 0) return -1;
	*len = get32(hdr);
	*type = hdr[4];
	if (*len > MAX_FRAME) return -1;
	return read_full(fd, buf, *len);
}

/* ------------------------------------------------------------------ request fields */

struct field {
	uint8_t tag;
	uint32_t len;
	const uint8_t *val;
};

/* Iterates TLV fields: tag u8, length u32 BE, value. Returns 0 at the end, -1 if malformed. */
static int next_field(const uint8_t *buf, uint32_t n, uint32_t *off, struct field *f)
{
	if (*off == n) return 0;
	if (n - *off < 5) return -1;
	f->tag = buf[*off];
	f->len = get32(buf + *off + 1);
	if (f->len > n - *off - 5) return -1;
	f->val = buf + *off + 5;
	*off += 5 + f->len;
	return 1;
}

/* A NUL-terminated copy; NULL if the value holds a NUL byte. */
static char *field_str(const struct field *f)
{
	if (memchr(f->val, 0, f->len)) return NULL;
	char *s = malloc(f->len + 1);
	if (!s) _exit(1);
	memcpy(s, f->val, f->len);
	s[f->len] = 0;
	return s;
}

static uint64_t field_u64(const struct field *f)
{
	uint64_t v = 0;
	for (uint32_t i = 0; i < f->len && i < 8; i++) v = v << 8 | f->val[i];
	return v;
}

/* ------------------------------------------------------------------ exec */

struct stream {
	int fd;              /* read end of the command's pipe, -1 at EOF */
	uint8_t type;        /* '1' stdout, '2' stderr */
	uint64_t head_left;  /* bytes still streamed live */
	uint64_t cap;        /* tail ring size */
	uint8_t *ring;       /* mmap'd on first use, so small outputs cost nothing */
	uint64_t pos, len, dropped;
};

/* Head bytes go out live; past the head, only the last `cap` bytes are kept. */
static void emit(int c, struct stream *s, const uint8_t *d, size_t n)
{
	if (s->head_left) {
		size_t k = n < s->head_left ? n : (size_t)s->head_left;
		send_frame(c, s->type, d, k);
		s->head_left -= k;
		d += k;
		n -= k;
	}
	if (!n) return;
	if (!s->ring && s->cap) {
		void *m = mmap(NULL, s->cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED) s->cap = 0;
		else s->ring = m;
	}
	if (!s->cap) {
		s->dropped += n;
		return;
	}
	if (n >= s->cap) {
		s->dropped += s->len + (n - s->cap);
		memcpy(s->ring, d + n - s->cap, s->cap);
		s->pos = 0;
		s->len = s->cap;
		return;
	}
	uint64_t over = s->len + n > s->cap ? s->len + n - s->cap : 0;
	uint64_t w = (s->pos + s->len) % s->cap;
	uint64_t first = s->cap - w < n ? s->cap - w : n;
	memcpy(s->ring + w, d, first);
	memcpy(s->ring, d + first, n - first);
	s->dropped += over;
	s->len = s->len + n - over;
	s->pos = (s->pos + over) % s->cap;
}

static void flush_tail(int c, struct stream *s)
{
	while (s->len) {
		uint64_t k = s->cap - s->pos < s->len ? s->cap - s->pos : s->len;
		if (k > CHUNK) k = CHUNK;
		send_frame(c, s->type, s->ring + s->pos, k);
		s->pos = (s->pos + k) % s->cap;
		s->len -= k;
	}
}

/* Returns 0 at EOF or a hard error, 1 if data was read, -1 if nothing is there now. */
static int pump(int c, struct stream *s)
{
	ssize_t r = read(s->fd, io_buf, PIPE_READ);
	if (r > 0) {
		emit(c, s, io_buf, (size_t)r);
		return 1;
	}
	if (r < 0 && (errno == EAGAIN || errno == EINTR)) return -1;
	close(s->fd);
	s->fd = -1;
	return 0;
}

/* Sends `fd` (SCM_RIGHTS) with the bytes `data`; sendmsg's result. */
static ssize_t send_fd(int s, int fd, const void *data, size_t n, int flags)
{
	char cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {.iov_base = (void *)data, .iov_len = n};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			    .msg_controllen = sizeof cbuf};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &fd, sizeof fd);
	return sendmsg(s, &mh, flags | MSG_NOSIGNAL);
}

/* One fd passed with a 1-byte message, non-blocking; -1 if none came. */
static int recv_fd(int s)
{
	char cbuf[CMSG_SPACE(sizeof(int))];
	uint8_t dummy;
	struct iovec iov = {.iov_base = &dummy, .iov_len = 1};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			    .msg_controllen = sizeof cbuf};
	struct cmsghdr *cm;
	int fd = -1;
	if (recvmsg(s, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) > 0 && (cm = CMSG_FIRSTHDR(&mh)) &&
	    cm->cmsg_type == SCM_RIGHTS)
		memcpy(&fd, CMSG_DATA(cm), sizeof fd);
	return fd;
}

/* Pipes still open after the command exited belong to its background jobs:
 * PID 1 keeps reading them so those jobs never die of SIGPIPE. */
static void hand_off(int fd)
{
	uint8_t dummy = 0;
	send_fd(handoff[1], fd, &dummy, 1, MSG_DONTWAIT);
	close(fd);
}

/* ------------------------------------------------------------------ users */

struct cred {
	int set;
	uid_t uid;
	gid_t gid;
	size_t ngroups;
	gid_t groups[MAX_GROUPS];
	char *name, *home;
};

/* A decimal id that fits uid_t/gid_t (and is not -1). */
static int parse_id(const char *s, unsigned long *out)
{
	char *end;
	if (!*s || *s < '0' || *s > '9') return 0;
	errno = 0;
	unsigned long v = strtoul(s, &end, 10);
	if (*end || errno || v >= 0xffffffffUL) return 0;
	*out = v;
	return 1;
}

/* Splits a passwd/group line in place at ':'; returns the field count. */
static int split_colon(char *line, char **f, int max)
{
	int n = 0;
	line[strcspn(line, "\n")] = 0;
	f[n++] = line;
	for (char *s = line; *s && n < max; s++)
		if (*s == ':') *s = 0, f[n++] = s + 1;
	return n;
}

static int has_member(char *list, const char *name)
{
	for (char *m = strtok(list, ","); m; m = strtok(NULL, ","))
		if (!strcmp(m, name)) return 1;
	return 0;
}

/* Resolves "user[:group]" (names or numbers) from the sandbox's own
 * /etc/passwd and /etc/group: no NSS, so a static binary resolves the image's
 * users exactly. Returns 0, or an errno with `msg` filled. */
static int resolve_user(const char *spec, struct cred *cr, char *msg, size_t ml)
{
	char *u = strdup(spec), *g, *line = NULL, *f[7];
	size_t cap = 0;
	unsigned long num = 0, gnum = 0;
	if (!u) _exit(1);
	if ((g = strchr(u, ':'))) *g++ = 0;
	if (!*u || (g && !*g)) {
		snprintf(msg, ml, "user '%s' is not a name, a uid or uid:gid", spec);
		return EINVAL;
	}
	int by_id = parse_id(u, &num), found = 0;
	FILE *fp = fopen("/etc/passwd", "re");
	while (fp && getline(&line, &cap, fp) > 0) {
		unsigned long pu, pg;
		if (split_colon(line, f, 7) < 6 || !parse_id(f[2], &pu) || !parse_id(f[3], &pg)) continue;
		if (by_id ? pu != num : strcmp(f[0], u)) continue;
		found = 1;
		cr->uid = (uid_t)pu;
		cr->gid = (gid_t)pg;
		cr->name = strdup(f[0]);
		cr->home = strdup(*f[5] ? f[5] : "/");
		break;
	}
	if (fp) fclose(fp);
	if (!found) {
		if (!by_id) {
			snprintf(msg, ml, "user '%s' does not exist in the sandbox's /etc/passwd", u);
			return EINVAL;
		}
		/* a bare uid with no entry: its own gid, HOME=/ (documented in protocol.py) */
		cr->uid = (uid_t)num;
		cr->gid = (gid_t)num;
		cr->name = strdup(u);
		cr->home = "/";
	}
	int by_gid = g && parse_id(g, &gnum), gfound = by_gid;
	cr->ngroups = 0;
	if (!g) cr->groups[cr->ngroups++] = cr->gid;
	fp = (g && by_gid) ? NULL : fopen("/etc/group", "re");
	while (fp && getline(&line, &cap, fp) > 0) {
		unsigned long gid;
		if (split_colon(line, f, 4) < 4 || !parse_id(f[2], &gid)) continue;
		if (g) {
			if (strcmp(f[0], g)) continue;
			gfound = 1;
			gnum = gid;
			break;
		}
		/* supplementary groups: every group that lists the user by name */
		if (found && cr->ngroups < MAX_GROUPS && gid != cr->gid && has_member(f[3], cr->name))
			cr->groups[cr->ngroups++] = (gid_t)gid;
	}
	if (fp) fclose(fp);
	free(line);
	if (g) {
		if (!gfound) {
			snprintf(msg, ml, "group '%s' does not exist in the sandbox's /etc/group", g);
			return EINVAL;
		}
		cr->gid = (gid_t)gnum;
		cr->groups[cr->ngroups++] = cr->gid;
	}
	cr->set = 1;
	return 0;
}

/* ------------------------------------------------------------------ commands */

/* An exec or spawn request, parsed. */
struct cmd {
	char **argv, **renv;
	size_t n_env;
	char *cwd, *user, *summary;
	uint64_t timeout_ms, max_out, grace_ms;
	int has_timeout, close_stdin;
	struct cred cred;
	char **env;
};

static char **build_env(struct cmd *cm)
{
	static const char *defaults[] = {
	    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"};
	char *uenv[3];
	size_t n_own = 0, n_user = 0;
	while (environ[n_own]) n_own++;
	if (cm->cred.set) {
		const char *k[3] = {"HOME=", "USER=", "LOGNAME="};
		for (int i = 0; i < 3; i++) {
			const char *v = i ? cm->cred.name : cm->cred.home;
			if (!(uenv[i] = malloc(strlen(k[i]) + strlen(v) + 1))) _exit(1);
			strcat(strcpy(uenv[i], k[i]), v);
		}
		n_user = 3;
	}
	char **env = calloc(2 + n_own + n_user + cm->n_env + 1, sizeof *env);
	size_t n = 0;
	if (!env) _exit(1);
	/* Later entries win: defaults < the agent's own env < the user's HOME/USER/LOGNAME
	 * < the request's env. */
	for (int layer = 0; layer < 4; layer++) {
		size_t count = layer == 0 ? 2 : layer == 1 ? n_own : layer == 2 ? n_user : cm->n_env;
		for (size_t i = 0; i < count; i++) {
			char *kv = layer == 0   ? (char *)defaults[i]
				   : layer == 1 ? environ[i]
				   : layer == 2 ? uenv[i]
						: cm->renv[i];
			const char *eq = strchr(kv, '=');
			size_t klen = eq ? (size_t)(eq - kv) : strlen(kv);
			size_t j;
			for (j = 0; j < n; j++)
				if (!strncmp(env[j], kv, klen) && env[j][klen] == '=') break;
			env[j] = kv;
			if (j == n) n++;
		}
	}
	env[n] = NULL;
	return env;
}

/* Parses exec/spawn fields, resolves the user, enters cwd and builds the env.
 * Returns 0, or -1 after answering an error. */
static int parse_cmd(int c, const uint8_t *req, uint32_t n, struct cmd *cm, const char *op)
{
	struct field f;
	uint32_t off = 0;
	size_t n_argv = 0;
	char *shell = NULL;
	int r;
	while ((r = next_field(req, n, &off, &f)) > 0) n_argv += f.tag == 'a', cm->n_env += f.tag == 'e';
	cm->argv = calloc(n_argv + 4, sizeof *cm->argv);
	cm->renv = calloc(cm->n_env + 1, sizeof *cm->renv);
	if (!cm->argv || !cm->renv) _exit(1);
	if (r < 0) {
		send_err(c, EINVAL, "%s: malformed request", op);
		return -1;
	}
	n_argv = cm->n_env = 0;
	off = 0;
	while ((r = next_field(req, n, &off, &f)) > 0) {
		char *s = NULL;
		if (f.tag && strchr("acdeu", f.tag) && !(s = field_str(&f))) {
			send_err(c, EINVAL, "%s: argument, env, cwd or user contains a NUL byte", op);
			return -1;
		}
		switch (f.tag) {
		case 'a': cm->argv[n_argv++] = s; break;
		case 'c': shell = s; break;
		case 'e':
			if (!strchr(s, '=')) {
				send_err(c, EINVAL, "%s: env entry '%s' has no '='", op, s);
				return -1;
			}
			cm->renv[cm->n_env++] = s;
			break;
		case 'd': cm->cwd = s; break;
		case 'u': cm->user = s; break;
		case 't': cm->timeout_ms = field_u64(&f), cm->has_timeout = 1; break;
		case 'o': cm->max_out = field_u64(&f); break;
		case 'g': cm->grace_ms = field_u64(&f); break;
		case 'n': cm->close_stdin = field_u64(&f) != 0; break;
		}
	}
	if (r < 0 || (!shell && !n_argv)) {
		send_err(c, EINVAL, "%s: malformed request (no command)", op);
		return -1;
	}
	if (shell) {
		cm->argv[0] = "/bin/sh";
		cm->argv[1] = "-c";
		cm->argv[2] = shell;
		cm->argv[3] = NULL;
	}
	/* a one-line summary for process listings */
	if (!(cm->summary = calloc(1, 1025))) _exit(1);
	for (char **a = shell ? &shell : cm->argv; *a; a++) {
		size_t have = strlen(cm->summary);
		snprintf(cm->summary + have, 1025 - have, "%s%s", have ? " " : "", *a);
		if (shell) break;
	}
	if (cm->user) {
		char msg[512];
		int e = resolve_user(cm->user, &cm->cred, msg, sizeof msg);
		if (e) {
			send_err(c, e, "%s", msg);
			return -1;
		}
	}
	if (cm->cwd) {
		struct stat st;
		int e = 0;
		if (stat(cm->cwd, &st) < 0) e = errno;
		else if (!S_ISDIR(st.st_mode)) e = ENOTDIR;
		else if (chdir(cm->cwd) < 0) e = errno;
		if (e) {
			send_err(c, e, "cwd '%s': %s", cm->cwd, e == ENOENT ? "no such directory" : strerror(e));
			return -1;
		}
	}
	cm->env = build_env(cm);
	return 0;
}

/* The agent holds CAP_SETUID/CAP_SETGID only to switch users and CAP_KILL to
 * stop any command; commands run without them. Dropping needs no capability, and with
 * no_new_privs execve cannot regain what is not in the permitted set. */
static void drop_id_caps(void)
{
	struct {
		uint32_t version;
		int pid;
	} hdr = {0x20080522 /* _LINUX_CAPABILITY_VERSION_3 */, 0};
	struct {
		uint32_t effective, permitted, inheritable;
	} data[2];
	/* runc sets it for containers already; without it a root execve regains the
	 * whole bounding set. */
	prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
	if (syscall(SYS_capget, &hdr, data) < 0) return;
	/* CAP_KILL too: with it a root command could signal the agent's processes
	 * despite their guard uid. Root commands still signal their own kind. */
	uint32_t mask = ~((1u << 5) | (1u << 6) | (1u << 7)); /* CAP_KILL, CAP_SETGID, CAP_SETUID */
	data[0].effective &= mask;
	data[0].permitted &= mask;
	data[0].inheritable &= mask;
	syscall(SYS_capset, &hdr, data);
}

static void run_child(struct cmd *cm, int in, int out, int err, int errfd)
{
	setsid();
	dup2(in, 0);
	dup2(out, 1);
	dup2(err, 2);
	for (int sig = 1; sig < NSIG; sig++) signal(sig, SIG_DFL);
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	const struct cred *cr = &cm->cred;
	/* same ids as ours: nothing to switch, so no capability is needed */
	uid_t ruid, euid, suid;
	getresuid(&ruid, &euid, &suid);
	int bad = 0;
	if (cr->set && (cr->uid != euid || cr->gid != getegid()))
		bad = setgroups(cr->ngroups, cr->groups) < 0 || setgid(cr->gid) < 0 || setuid(cr->uid) < 0;
	else if (ruid != euid || suid != euid)
		bad = setresuid(euid, euid, euid) < 0; /* shed the agent's guard uid (see main) */
	if (bad) {
		int e = errno;
		if (write(errfd, &e, sizeof e) < 0) _exit(126);
		_exit(126);
	}
	drop_id_caps();
	environ = cm->env; /* execvp searches the command's own PATH */
	execvp(cm->argv[0], cm->argv);
	int e = errno;
	dprintf(2, "sandfleet-agent: %s: %s\n", cm->argv[0], e == ENOENT ? "command not found" : strerror(e));
	_exit(e == ENOENT ? 127 : 126);
}

/* Forks the command on the given pipe ends and waits until it has exec'd (or
 * failed to). Returns its pid, or -1 with the errno in *err (and *cred_fail if
 * switching user failed; then the child is already reaped). */
static pid_t start_cmd(struct cmd *cm, int in, int out, int errp, int *err, int *cred_fail)
{
	int ep[2];
	*cred_fail = 0;
	if (pipe2(ep, O_CLOEXEC) < 0) {
		*err = errno;
		return -1;
	}
	pid_t pid = fork();
	if (pid == 0) run_child(cm, in, out, errp, ep[1]);
	int fe = errno;
	close(ep[1]);
	if (pid < 0) {
		close(ep[0]);
		*err = fe;
		return -1;
	}
	int e = 0;
	ssize_t r;
	/* EOF at execve (the pipe is close-on-exec), or the errno of a failed switch */
	while ((r = read(ep[0], &e, sizeof e)) < 0 && errno == EINTR) {
	}
	close(ep[0]);
	if (r == (ssize_t)sizeof e) {
		waitpid(pid, NULL, 0);
		*err = e;
		*cred_fail = 1;
		return -1;
	}
	return pid;
}

static void start_failed(int c, struct cmd *cm, int e, int cred_fail, const char *op)
{
	if (cred_fail && e == EPERM)
		send_err(c, EPERM,
			 "cannot run as user '%s': the sandbox lacks CAP_SETUID/CAP_SETGID "
			 "(the node must grant them to switch users)",
			 cm->user);
	else if (cred_fail)
		send_err(c, e, "cannot run as user '%s': %s", cm->user, strerror(e));
	else
		send_err(c, e, "%s: fork: %s (process limit reached?)", op, strerror(e));
}

/* The "oom_kill N" count in --oom-events (cgroup v2 memory.events, v1
 * memory.oom_control), or -1 without the option or when unreadable. */
static long long kernel_oom_kills(void)
{
	char buf[1024];
	int fd = oom_events ? open(oom_events, O_RDONLY | O_CLOEXEC) : -1;
	if (fd < 0) return -1;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0) return -1;
	buf[n] = 0;
	for (char *line = buf; line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
		if (!strncmp(line, "oom_kill ", 9)) return strtoll(line + 9, NULL, 10);
	return -1;
}

/* The kernel's OOM kills plus PID 1's early OOM killer's (see psi_tick), or -1. */
static long long oom_kills(void)
{
	long long k = kernel_oom_kills();
	if (k < 0 || !psi_on || !psi_kills) return k;
	return k + (long long)__atomic_load_n(psi_kills, __ATOMIC_SEQ_CST);
}

static void op_exec(int c, const uint8_t *req, uint32_t n)
{
	struct cmd cm = {.timeout_ms = 60000, .max_out = 16u << 20};
	/* a subreaper: whatever the command forks stays below us, whatever it does */
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	if (parse_cmd(c, req, n, &cm, "exec") < 0) return;
	uint64_t timeout_ms = cm.timeout_ms, max_out = cm.max_out;
	grace_ms = cm.grace_ms;

	int pin[2], pout[2], perr[2];
	if (pipe2(pin, O_CLOEXEC) < 0 || pipe2(pout, O_CLOEXEC) < 0 || pipe2(perr, O_CLOEXEC) < 0) {
		send_err(c, errno, "exec: pipe: %s", strerror(errno));
		return;
	}
	uint64_t t0 = now_ns();
	long long ooms = oom_kills();
	int e, cred_fail;
	pid_t pid = start_cmd(&cm, pin[0], pout[1], perr[1], &e, &cred_fail);
	if (pid < 0) {
		start_failed(c, &cm, e, cred_fail, "exec");
		return;
	}
	cmd_pid = pid;
	close(pin[0]);
	close(pout[1]);
	close(perr[1]);
	fcntl(c, F_SETFL, O_NONBLOCK);
	sock_nonblock = 1;
	fcntl(pin[1], F_SETFL, O_NONBLOCK);
	fcntl(pout[0], F_SETFL, O_NONBLOCK);
	fcntl(perr[0], F_SETFL, O_NONBLOCK);
	arm_timer(timeout_ms);

	struct stream so = {pout[0], '1', max_out - max_out / 2, max_out / 2, NULL, 0, 0, 0};
	struct stream se = {perr[0], '2', max_out - max_out / 2, max_out / 2, NULL, 0, 0, 0};
	/* stdin: frames are read off the socket one at a time into data_buf */
	int in_fd = pin[1], in_eof = 0;
	uint8_t hdr[5];
	uint32_t hgot = 0, plen = 0, pgot = 0, pdone = 0, have = 0;

	for (;;) {
		check_timer();
		if (got_chld) reap_kids();
		if (cmd_done) break;
		struct pollfd p[4] = {
		    {.fd = so.fd, .events = POLLIN}, {.fd = se.fd, .events = POLLIN},
		    {.fd = c, .events = (!have && !in_eof) ? POLLIN : 0},
		    {.fd = have && in_fd >= 0 ? in_fd : -1, .events = POLLOUT}};
		if (ppoll(p, 4, NULL, &wait_mask) < 0) continue;
		if (p[0].revents) pump(c, &so);
		if (p[1].revents) pump(c, &se);
		if (p[2].revents & POLLIN) {
			/* incremental frame reader: never blocks, so the timer always fires */
			ssize_t k;
			if (hgot < 5) {
				k = read(c, hdr + hgot, 5 - hgot);
				if (k == 0) client_gone();
				if (k > 0 && (hgot += (uint32_t)k) == 5) {
					plen = get32(hdr);
					pgot = 0;
					if (plen > MAX_FRAME || (hdr[4] != 'D' && hdr[4] != 'Z')) client_gone();
				}
			} else {
				k = read(c, data_buf + pgot, plen - pgot);
				if (k == 0) client_gone();
				if (k > 0) pgot += (uint32_t)k;
			}
			if (hgot == 5 && pgot == plen) {
				hgot = 0;
				if (hdr[4] == 'Z') {
					in_eof = 1;
					if (in_fd >= 0) close(in_fd);
					in_fd = -1;
				} else if (in_fd >= 0) {
					have = plen;
					pdone = 0;
				}
			}
		} else if (p[2].revents & (POLLHUP | POLLERR)) {
			client_gone();
		}
		if (p[3].revents) {
			ssize_t w = write(in_fd, data_buf + pdone, have - pdone);
			if (w > 0 && (pdone += (uint32_t)w) == have) have = 0;
			if (w < 0 && errno != EAGAIN && errno != EINTR) {
				/* the command closed its stdin: discard the rest */
				close(in_fd);
				in_fd = -1;
				have = 0;
			}
		}
	}
	uint64_t dur = now_ns() - t0;
	struct itimerval off_timer = {{0, 0}, {0, 0}};
	setitimer(ITIMER_REAL, &off_timer, NULL);
	/* Timed out: the rest of the tree goes too (during a grace period the main
	 * process may have exited on SIGTERM, leaving children). A normal exit
	 * leaves background jobs running: they pass to PID 1 when we exit. */
	if (timed_out) kill_tree();
	int status = cmd_status;
	cmd_pid = 0;
	if (in_fd >= 0) close(in_fd);
	/* What the command wrote before exiting is already in the pipes; read it,
	 * but never wait for background jobs that still hold the write ends. */
	struct stream *streams[2] = {&so, &se};
	for (int k = 0; k < 2; k++) {
		struct stream *s = streams[k];
		for (int i = 0; s->fd >= 0 && i < 64 && pump(c, s) > 0; i++) {
		}
		if (s->fd >= 0) hand_off(s->fd);
		flush_tail(c, s);
	}
	uint8_t res[33] = {0};
	if (timed_out) {
		res[0] = 2;
	} else if (WIFSIGNALED(status)) {
		res[0] = 1;
		put32(res + 5, (uint32_t)WTERMSIG(status));
	} else {
		put32(res + 1, (uint32_t)WEXITSTATUS(status));
	}
	/* It failed while the memory limit killed something (the command, or a
	 * child a shell reports as 137): oom, not a code that passes for its own. */
	int failed = res[0] == 1 || (res[0] == 0 && WEXITSTATUS(status) != 0);
	if (failed && ooms >= 0 && oom_kills() > ooms) res[0] = 3;
	put64(res + 9, so.dropped);
	put64(res + 17, se.dropped);
	put64(res + 25, dur);
	send_frame(c, 'X', res, sizeof res);
}

/* ------------------------------------------------------------------ files */

static const char *base_name(const char *path)
{
	const char *end = path + strlen(path);
	while (end > path + 1 && end[-1] == '/') end--;
	const char *b = end;
	while (b > path && b[-1] != '/') b--;
	return b;
}

/* Entry frame: type u8, size u64, mode u32, mtime_ns i64, then the name. */
static void send_entry(int c, const char *name, const struct stat *st)
{
	uint8_t buf[25 + NAME_MAX + 1];
	size_t nl = strlen(name);
	if (nl > NAME_MAX + 1) nl = NAME_MAX + 1;
	buf[0] = S_ISREG(st->st_mode) ? 0 : S_ISDIR(st->st_mode) ? 1 : S_ISLNK(st->st_mode) ? 2 : 3;
	put64(buf + 1, (uint64_t)st->st_size);
	put32(buf + 9, st->st_mode & 07777);
	put64(buf + 13, (uint64_t)st->st_mtim.tv_sec * 1000000000u + (uint64_t)st->st_mtim.tv_nsec);
	memcpy(buf + 21, name, nl);
	send_frame(c, 'F', buf, 21 + nl);
}

static int stat_reply(int c, const char *what, const char *path)
{
	struct stat st;
	if (lstat(path, &st) < 0) {
		send_err(c, errno, "%s '%s': %s", what, path, strerror(errno));
		return -1;
	}
	send_entry(c, base_name(path), &st);
	return 0;
}

static void op_read(int c, const char *path)
{
	struct stat st;
	/* O_NONBLOCK: opening a FIFO must not wait for a writer. The type is checked
	 * on the open file, so a symlink to a device or FIFO is refused too. */
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0) {
		send_err(c, errno, "read '%s': %s", path, strerror(errno));
		return;
	}
	if (fstat(fd, &st) < 0) {
		send_err(c, errno, "read '%s': %s", path, strerror(errno));
		return;
	}
	if (S_ISDIR(st.st_mode)) {
		send_err(c, EISDIR, "read '%s': is a directory", path);
		return;
	}
	if (!S_ISREG(st.st_mode)) {
		/* a device such as /dev/zero or a FIFO would never end */
		send_err(c, EINVAL, "read '%s': not a regular file (device, FIFO or socket): only"
			 " regular files can be read", path);
		return;
	}
	fcntl(fd, F_SETFL, 0);
	for (;;) {
		ssize_t r = read(fd, io_buf, CHUNK);
		if (r < 0 && errno == EINTR) continue;
		if (r < 0) {
			send_err(c, errno, "read '%s': %s", path, strerror(errno));
			return;
		}
		if (r == 0) break;
		send_frame(c, 'D', io_buf, (size_t)r);
	}
	send_frame(c, 'Z', NULL, 0);
}

static char tmp_path[PATH_MAX + 64];

static void op_write(int c, const char *path, mode_t mode)
{
	struct stat st;
	const char *b = base_name(path);
	int e = 0;
	if (!*b || !strcmp(b, ".") || !strcmp(b, "..")) e = EINVAL;
	else if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) e = EISDIR;
	else if (snprintf(tmp_path, sizeof tmp_path, "%.*s.sandfleet-%d.tmp", (int)(b - path), path,
			  (int)getpid()) >= (int)sizeof tmp_path) e = ENAMETOOLONG;
	int fd = e ? -1 : open(tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (!e && fd < 0) {
		e = errno;
		/* The file exists but no file can be made beside it (procfs, sysfs, a
		 * read-only mount): say so, not "no such file". */
		if (lstat(path, &st) == 0) {
			send_err(c, e == ENOENT ? EACCES : e,
				 "write '%s': an atomic write needs a temporary file in its directory,"
				 " which refuses one (%s)", path, strerror(e));
			return;
		}
	}
	if (e) {
		send_err(c, e, "write '%s': %s", path, e == EISDIR ? "is a directory" : strerror(e));
		return;
	}
	uint8_t type = 0;
	uint32_t len;
	for (;;) {
		if (read_frame(c, &type, data_buf, &len) < 0) {
			unlink(tmp_path); /* client gone mid-upload: leave nothing behind */
			_exit(0);
		}
		if (type == 'Z') break;
		const uint8_t *p = data_buf;
		while (!e && len) {
			ssize_t w = write(fd, p, len);
			if (w < 0 && errno == EINTR) continue;
			if (w < 0) e = errno;
			else p += w, len -= (uint32_t)w;
		}
		if (e) break;
	}
	if (!e && fchmod(fd, mode & 07777) < 0) e = errno;
	if (close(fd) < 0 && !e) e = errno;
	if (!e && rename(tmp_path, path) < 0) e = errno;
	if (e) {
		unlink(tmp_path);
		send_err(c, e, "write '%s': %s", path, strerror(e));
		return;
	}
	stat_reply(c, "write", path);
}

static void op_list(int c, const char *path)
{
	DIR *d = opendir(path);
	if (!d) {
		send_err(c, errno, "list '%s': %s", path, strerror(errno));
		return;
	}
	struct dirent *de;
	struct stat st;
	while ((de = readdir(d))) {
		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
		if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue; /* vanished */
		send_entry(c, de->d_name, &st);
	}
	closedir(d);
	send_frame(c, 'Z', NULL, 0);
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)ftw;
	return flag == FTW_DP ? rmdir(p) : unlink(p);
}

static void op_remove(int c, const char *path, int recursive)
{
	struct stat st;
	int r;
	if (lstat(path, &st) < 0) r = -1;
	else if (!S_ISDIR(st.st_mode)) r = unlink(path);
	else if (recursive) r = nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
	else r = rmdir(path);
	if (r < 0) send_err(c, errno, "remove '%s': %s", path, strerror(errno));
	else send_frame(c, 'K', NULL, 0);
}

static void op_mkdir(int c, char *path, int parents, mode_t mode)
{
	int r = 0;
	if (parents) {
		/* mkdir -p: every missing prefix, an existing directory is fine */
		for (char *s = path + 1;; s++) {
			if (*s && *s != '/') continue;
			char saved = *s;
			*s = 0;
			struct stat st;
			r = mkdir(path, mode);
			if (r < 0 && errno == EEXIST && stat(path, &st) == 0 && S_ISDIR(st.st_mode)) r = 0;
			*s = saved;
			if (r < 0 || !saved) break;
		}
	} else {
		r = mkdir(path, mode);
	}
	if (r < 0) {
		send_err(c, errno, "mkdir '%s': %s", path, strerror(errno));
		return;
	}
	stat_reply(c, "mkdir", path);
}

static size_t put_field(uint8_t *p, uint8_t tag, const char *val)
{
	size_t n = strlen(val);
	p[0] = tag;
	put32(p + 1, (uint32_t)n);
	memcpy(p + 5, val, n);
	return 5 + n;
}

static void op_ping(int c)
{
	uint8_t buf[64];
	char pid[16];
	snprintf(pid, sizeof pid, "%d", (int)main_pid);
	size_t n = put_field(buf, 'v', VERSION);
	n += put_field(buf + n, 'p', pid);
	send_frame(c, 'K', buf, n);
}

/* ------------------------------------------------------------------ spawn: supervisor */

/* Output of a spawned process: the last `cap` bytes, addressed by absolute
 * offset (byte `a` is at buf[a % cap] while total - cap <= a < total). */
struct ring {
	int fd, eof;
	uint64_t cap, total;
	uint8_t *buf;
};

/* A caller waiting for the process to end ('W'), for output past an offset
 * ('n'), or for the initial stdin to be written before getting the pipe ('i'). */
struct park {
	int fd;
	uint8_t op, stream;
	uint64_t off, deadline;
};

enum { ST_RUNNING, ST_EXITED, ST_SIGNALED, ST_KILLED, ST_TIMEOUT };

static struct sup {
	char id[24];
	struct cmd *cm;
	pid_t pid;
	int ls, state, code, sig, ended, kill_req;
	uint64_t started, ended_at; /* Unix time, ns */
	uint64_t deadline, kill_at; /* monotonic ns, 0 = none */
	struct ring out[2];
	int in_fd, close_after;
	uint8_t *in_buf;
	size_t in_len, in_off;
	struct park park[MAX_PARK];
	int npark;
} S;

static uint8_t sink[16384];

static uint64_t wall_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static size_t put_tlv(uint8_t *p, uint8_t tag, const void *val, size_t n)
{
	p[0] = tag;
	put32(p + 1, (uint32_t)n);
	memcpy(p + 5, val, n);
	return 5 + n;
}

static size_t put_u64_field(uint8_t *p, uint8_t tag, uint64_t v)
{
	uint8_t b[8];
	put64(b, v);
	return put_tlv(p, tag, b, 8);
}

/* Writes a whole frame (header + up to two payload pieces); never exits. */
static int send_parts(int fd, uint8_t type, const void *a, size_t an, const void *b, size_t bn,
		      const void *d, size_t dn)
{
	uint8_t hdr[5];
	put32(hdr, (uint32_t)(an + bn + dn));
	hdr[4] = type;
	struct iovec iov[4] = {{hdr, 5}, {(void *)a, an}, {(void *)b, bn}, {(void *)d, dn}};
	struct iovec *v = iov;
	int nv = 4;
	while (nv) {
		struct msghdr mh = {.msg_iov = v, .msg_iovlen = (size_t)nv};
		ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR) continue;
		if (w < 0) return -1;
		while (nv && (size_t)w >= v->iov_len) w -= (ssize_t)v->iov_len, v++, nv--;
		if (nv) v->iov_base = (uint8_t *)v->iov_base + w, v->iov_len -= (size_t)w;
	}
	return 0;
}

static void sup_err(int fd, int err, const char *fmt, ...)
{
	uint8_t msg[4 + 512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf((char *)msg + 4, sizeof msg - 4, fmt, ap);
	va_end(ap);
	if (n < 0) n = 0;
	if ((size_t)n > sizeof msg - 5) n = sizeof msg - 5;
	put32(msg, (uint32_t)err);
	send_parts(fd, 'E', msg, 4 + (size_t)n, NULL, 0, NULL, 0);
}

/* The 'P' record: TLV fields, see protocol.py. */
static void sup_record(int fd)
{
	uint8_t buf[1200 + sizeof S.id];
	size_t n = put_tlv(buf, 'i', S.id, strlen(S.id));
	n += put_u64_field(buf + n, 'p', (uint64_t)S.pid);
	n += put_tlv(buf + n, 'c', S.cm->summary, strlen(S.cm->summary));
	uint8_t st = (uint8_t)S.state;
	n += put_tlv(buf + n, 's', &st, 1);
	if (S.state == ST_EXITED) n += put_u64_field(buf + n, 'x', (uint64_t)S.code);
	if (S.state == ST_SIGNALED || S.state == ST_KILLED) n += put_u64_field(buf + n, 'g', (uint64_t)S.sig);
	n += put_u64_field(buf + n, 'b', S.started);
	if (S.ended) n += put_u64_field(buf + n, 'n', S.ended_at);
	n += put_u64_field(buf + n, 'O', S.out[0].total);
	n += put_u64_field(buf + n, 'R', S.out[1].total);
	n += put_u64_field(buf + n, 'I', S.in_fd >= 0);
	send_parts(fd, 'P', buf, n, NULL, 0, NULL, 0);
}

/* Returns 1 if data was read, -1 if nothing is there now, 0 at EOF. */
static int ring_pump(struct ring *r)
{
	uint8_t *dst = sink;
	size_t room = sizeof sink;
	if (r->cap && !r->buf) {
		/* mapped on first output: untouched pages cost nothing */
		void *m = mmap(NULL, r->cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED) r->cap = 0;
		else r->buf = m;
	}
	if (r->cap) {
		uint64_t w = r->total % r->cap;
		dst = r->buf + w;
		room = r->cap - w < PIPE_READ ? (size_t)(r->cap - w) : PIPE_READ;
	}
	ssize_t k = read(r->fd, dst, room);
	if (k > 0) {
		r->total += (uint64_t)k;
		return 1;
	}
	if (k < 0 && (errno == EAGAIN || errno == EINTR)) return -1;
	close(r->fd);
	r->fd = -1;
	r->eof = 1;
	return 0;
}

static void done_marker(int create)
{
	char p[sizeof run_dir + 32];
	snprintf(p, sizeof p, "%s/%s.done", run_dir, S.id);
	if (!create) {
		unlink(p);
		return;
	}
	int fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
	if (fd >= 0) close(fd);
}

static void close_stdin_now(void)
{
	if (S.in_fd >= 0) close(S.in_fd);
	S.in_fd = -1;
	free(S.in_buf);
	S.in_buf = NULL;
	S.in_len = S.in_off = 0;
}

/* The main process was reaped: record how it ended. */
static void sup_check_end(void)
{
	if (S.ended || !cmd_done) return;
	/* what it wrote before exiting is in the pipes: take it now, so a follower
	 * that stops at the end sees all of it */
	for (int k = 0; k < 2; k++)
		for (int i = 0; i < 256 && S.out[k].fd >= 0 && ring_pump(&S.out[k]) > 0; i++) {
		}
	S.ended = 1;
	S.ended_at = wall_ns();
	if (timed_out) {
		S.state = ST_TIMEOUT; /* killed at its deadline */
	} else if (WIFSIGNALED(cmd_status)) {
		S.state = S.kill_req ? ST_KILLED : ST_SIGNALED;
		S.sig = WTERMSIG(cmd_status);
	} else {
		S.state = ST_EXITED;
		S.code = WEXITSTATUS(cmd_status);
	}
	close_stdin_now();
	if (timed_out) kill_tree();
	done_marker(1);
}

static void sup_exit(void)
{
	char p[sizeof run_dir + 32];
	snprintf(p, sizeof p, "%s/%s", run_dir, S.id);
	unlink(p);
	done_marker(0);
	_exit(0);
}

static void pass_fd(int s, int fd)
{
	uint8_t hdr[5] = {0, 0, 0, 0, 'K'};
	send_fd(s, fd, hdr, 5, 0);
}

/* Answers a parked caller if its condition holds (or its deadline passed). */
static int park_ready(struct park *p, uint64_t now)
{
	int expired = p->deadline && now >= p->deadline;
	switch (p->op) {
	case 'W':
		if (!S.ended && !expired) return 0;
		sup_record(p->fd);
		return 1;
	case 'n': {
		struct ring *r = &S.out[p->stream];
		if (r->total <= p->off && !S.ended && !r->eof && !expired) return 0;
		send_parts(p->fd, 'K', NULL, 0, NULL, 0, NULL, 0);
		return 1;
	}
	default: /* 'i' */
		if (S.in_fd >= 0 && S.in_off < S.in_len) return 0;
		if (S.in_fd < 0) sup_err(p->fd, EPIPE, "the stdin of process %s is closed", S.id);
		else pass_fd(p->fd, S.in_fd);
		return 1;
	}
}

static void park(int fd, uint8_t op, uint8_t stream, uint64_t off, uint64_t deadline)
{
	if (S.npark == MAX_PARK) {
		sup_err(fd, EAGAIN, "process %s has too many waiting callers", S.id);
		close(fd);
		return;
	}
	S.park[S.npark++] = (struct park){fd, op, stream, off, deadline};
}

static void sup_request(int a)
{
	uint8_t type;
	uint32_t len;
	struct field f;
	uint32_t off = 0;
	uint64_t offset = 0, tmo = 0, sig = SIGKILL;
	int stream = 0, has_t = 0;
	if (read_frame(a, &type, req_buf, &len) < 0) {
		close(a);
		return;
	}
	while (next_field(req_buf, len, &off, &f) > 0) {
		if (f.tag == 'S') stream = field_u64(&f) == 2;
		if (f.tag == 'F') offset = field_u64(&f);
		if (f.tag == 't') tmo = field_u64(&f), has_t = 1;
		if (f.tag == 'g') sig = field_u64(&f);
	}
	uint64_t deadline = has_t ? now_ns() + tmo * 1000000u : 0;
	switch (type) {
	case 'q': sup_record(a); break;
	case 'W':
		if (!S.ended && !(has_t && tmo == 0)) {
			park(a, 'W', 0, 0, deadline);
			return;
		}
		sup_record(a);
		break;
	case 'n': park(a, 'n', (uint8_t)stream, offset, deadline); return;
	case 'k':
		if (sig < 1 || sig >= NSIG) {
			sup_err(a, EINVAL, "signal %llu is not a valid signal number", (unsigned long long)sig);
			break;
		}
		if (!S.ended) S.kill_req = 1;
		if (sig == SIGKILL) {
			kill_tree();
		} else {
			if (!S.ended) kill(-S.pid, (int)sig);
			signal_tree((int)sig);
		}
		reap_kids();
		sup_check_end();
		sup_record(a);
		break;
	case 'i':
		if (S.ended) sup_err(a, EPIPE, "process %s has ended; it takes no more stdin", S.id);
		else if (S.in_fd < 0) sup_err(a, EPIPE, "the stdin of process %s is closed", S.id);
		else {
			park(a, 'i', 0, 0, 0);
			return;
		}
		break;
	case 'I':
		if (S.in_off < S.in_len) S.close_after = 1;
		else close_stdin_now();
		send_parts(a, 'K', NULL, 0, NULL, 0, NULL, 0);
		break;
	case 'o': {
		/* the bytes from max(offset, oldest retained), at most one chunk */
		struct ring *r = &S.out[stream];
		uint64_t oldest = r->total - (r->total < r->cap ? r->total : r->cap);
		uint64_t start = offset < oldest ? oldest : offset;
		if (start > r->total) start = r->total;
		uint64_t n = r->total - start < CHUNK ? r->total - start : CHUNK;
		uint8_t h[33];
		put64(h, start);
		put64(h + 8, start + n);
		put64(h + 16, start - (offset < start ? offset : start));
		put64(h + 24, r->total);
		h[32] = (uint8_t)((r->eof && start + n == r->total) | (S.ended << 1));
		uint64_t at = r->cap ? start % r->cap : 0;
		uint64_t first = r->cap && r->cap - at < n ? r->cap - at : n;
		send_parts(a, 'O', h, 33, r->buf ? r->buf + at : NULL, r->buf ? first : 0,
			   r->buf, r->buf ? n - first : 0);
		break;
	}
	case 'R':
		if (!S.ended) {
			sup_err(a, EBUSY, "process %s is still running: kill it or wait for it first", S.id);
			break;
		}
		send_parts(a, 'K', NULL, 0, NULL, 0, NULL, 0);
		close(a);
		sup_exit();
		break;
	default: sup_err(a, EINVAL, "unknown process request 0x%02x", type);
	}
	close(a);
}

/* The supervisor's loop: pipes into rings, stdin out, deadlines, callers. */
static void supervise(void)
{
	static struct pollfd p[4 + MAX_PARK];
	for (;;) {
		if (got_chld) reap_kids();
		sup_check_end();
		uint64_t now = now_ns();
		if (!S.ended && S.deadline && now >= S.deadline) {
			S.deadline = 0;
			timed_out = 1;
			if (S.cm->grace_ms) {
				kill(-S.pid, SIGTERM);
				signal_tree(SIGTERM);
				S.kill_at = now + S.cm->grace_ms * 1000000u;
			} else {
				kill_tree();
			}
			continue;
		}
		if (S.kill_at && now >= S.kill_at) {
			S.kill_at = 0;
			kill_tree();
			continue;
		}
		if (S.close_after && S.in_off >= S.in_len) S.close_after = 0, close_stdin_now();
		uint64_t next = S.ended ? 0 : S.deadline;
		if (S.kill_at && (!next || S.kill_at < next)) next = S.kill_at;
		for (int i = 0; i < S.npark; i++) {
			if (park_ready(&S.park[i], now)) {
				close(S.park[i].fd);
				S.park[i--] = S.park[--S.npark];
			} else if (S.park[i].deadline && (!next || S.park[i].deadline < next)) {
				next = S.park[i].deadline;
			}
		}
		p[0] = (struct pollfd){.fd = S.ls, .events = POLLIN};
		p[1] = (struct pollfd){.fd = S.out[0].fd, .events = POLLIN};
		p[2] = (struct pollfd){.fd = S.out[1].fd, .events = POLLIN};
		p[3] = (struct pollfd){.fd = S.in_off < S.in_len ? S.in_fd : -1, .events = POLLOUT};
		for (int i = 0; i < S.npark; i++) p[4 + i] = (struct pollfd){.fd = S.park[i].fd, .events = POLLIN};
		struct timespec ts, *tp = NULL;
		if (next) {
			uint64_t d = next > now ? next - now : 0;
			ts = (struct timespec){(time_t)(d / 1000000000u), (long)(d % 1000000000u)};
			tp = &ts;
		}
		if (ppoll(p, 4 + (nfds_t)S.npark, tp, &wait_mask) < 0) continue;
		for (int k = 0; k < 2; k++)
			if (p[1 + k].revents)
				for (int i = 0; i < 16 && S.out[k].fd >= 0 && ring_pump(&S.out[k]) > 0; i++) {
				}
		if (p[3].revents) {
			ssize_t w = write(S.in_fd, S.in_buf + S.in_off, S.in_len - S.in_off);
			if (w > 0) S.in_off += (size_t)w;
			else if (w < 0 && errno != EAGAIN && errno != EINTR) close_stdin_now();
		}
		/* a parked caller that hung up (they send nothing more) */
		for (int i = S.npark - 1; i >= 0; i--) {
			if (!p[4 + i].revents) continue;
			close(S.park[i].fd);
			S.park[i] = S.park[--S.npark];
		}
		if (p[0].revents & POLLIN) {
			for (int i = 0; i < 16; i++) {
				int a = accept4(S.ls, NULL, NULL, SOCK_CLOEXEC);
				if (a < 0) break;
				struct timeval tv = {2, 0};
				setsockopt(a, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
				setsockopt(a, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
				sup_request(a);
			}
		}
	}
}

static int sup_addr(struct sockaddr_un *a, const char *id)
{
	*a = (struct sockaddr_un){.sun_family = AF_UNIX};
	return snprintf(a->sun_path, sizeof a->sun_path, "%s/%s", run_dir, id) >= (int)sizeof a->sun_path;
}

/* In the freshly forked supervisor: listen, start the command, report to the
 * spawning handler over `rep` (i32 errno | i32 pid | message), then serve. */
static void start_supervisor(struct cmd *cm, const char *id, uint8_t *in_buf, size_t in_len, int rep)
{
	uint8_t msg[8 + 512] = {0};
	int e = 0, cred_fail = 0, n = 0;
	setsid();
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	char name[16];
	snprintf(name, sizeof name, "sfsup-%.9s", id); /* comm holds 15 bytes */
	prctl(PR_SET_NAME, name);
	close(handoff[1]);
	memset(&S, 0, sizeof S);
	snprintf(S.id, sizeof S.id, "%s", id);
	S.cm = cm;
	S.in_fd = -1;
	S.in_buf = in_buf;
	S.in_len = in_len;
	S.close_after = cm->close_stdin;
	S.out[0].cap = S.out[1].cap = cm->max_out;

	struct sockaddr_un a;
	int pin[2] = {-1, -1}, pout[2], perr[2];
	S.ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	sup_addr(&a, id);
	unlink(a.sun_path); /* a stale socket of an earlier agent run */
	mode_t old_mask = umask(0177); /* the socket is 0600 from the start; the dir is 0700 too */
	int br = S.ls < 0 ? -1 : bind(S.ls, (struct sockaddr *)&a, sizeof a);
	umask(old_mask);
	if (br < 0 || listen(S.ls, 64) < 0) {
		e = errno;
		n = snprintf((char *)msg + 8, 512, "spawn: cannot listen on %s: %s", a.sun_path, strerror(e));
	} else if (pipe2(pin, O_CLOEXEC) < 0 || pipe2(pout, O_CLOEXEC) < 0 || pipe2(perr, O_CLOEXEC) < 0) {
		e = errno;
		n = snprintf((char *)msg + 8, 512, "spawn: pipe: %s", strerror(e));
	} else if ((S.pid = cmd_pid = start_cmd(cm, pin[0], pout[1], perr[1], &e, &cred_fail)) < 0) {
		if (cred_fail && e == EPERM)
			n = snprintf((char *)msg + 8, 512,
				     "cannot run as user '%s': the sandbox lacks CAP_SETUID/CAP_SETGID "
				     "(the node must grant them to switch users)",
				     cm->user);
		else if (cred_fail)
			n = snprintf((char *)msg + 8, 512, "cannot run as user '%s': %s", cm->user, strerror(e));
		else
			n = snprintf((char *)msg + 8, 512, "spawn: fork: %s (process limit reached?)", strerror(e));
	}
	S.started = wall_ns();
	put32(msg, (uint32_t)e);
	put32(msg + 4, (uint32_t)(e ? 0 : S.pid));
	if (write(rep, msg, 8 + (size_t)(n > 0 ? n : 0)) < 0) e = e ? e : EPIPE;
	close(rep);
	if (e) {
		if (S.ls >= 0) unlink(a.sun_path);
		_exit(1);
	}
	close(pin[0]);
	close(pout[1]);
	close(perr[1]);
	if (chdir("/") < 0) { /* do not pin the command's cwd */
	}
	S.in_fd = pin[1];
	S.out[0].fd = pout[0];
	S.out[1].fd = perr[0];
	fcntl(pin[1], F_SETFL, O_NONBLOCK);
	fcntl(pout[0], F_SETFL, O_NONBLOCK);
	fcntl(perr[0], F_SETFL, O_NONBLOCK);
	if (cm->has_timeout) S.deadline = now_ns() + cm->timeout_ms * 1000000u;
	supervise();
}

/* ------------------------------------------------------------------ spawn: relay */

/* "p" and 1-19 digits: never a path. */
static int valid_id(const char *id)
{
	size_t n = strlen(id);
	if (n < 2 || n > 20 || id[0] != 'p' || id[1] == '0') return 0;
	for (size_t i = 1; i < n; i++)
		if (id[i] < '0' || id[i] > '9') return 0;
	return 1;
}

/* Connects to the supervisor of `id` and sends it one request; -1 after
 * answering NotFound (or returning quietly with c < 0). */
static int sup_open(int c, const char *id, uint8_t type, const uint8_t *payload, size_t n)
{
	struct sockaddr_un a;
	int s = -1, e = ENOENT;
	if (*run_dir && !sup_addr(&a, id) && (s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) >= 0 &&
	    connect(s, (struct sockaddr *)&a, sizeof a) == 0) {
		struct timeval tv = {IDLE_TIMEOUT_S, 0};
		setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
		setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
		if (send_parts(s, type, payload, n, NULL, 0, NULL, 0) == 0) return s;
	}
	if (s >= 0) e = errno, close(s);
	if (e == ECONNREFUSED && *run_dir) unlink(a.sun_path); /* its supervisor died */
	if (c >= 0)
		send_err(c, ENOENT, "no process '%s' in this sandbox (unknown id, or removed)", id);
	return -1;
}

/* Waits for the supervisor's answer; a client that hangs up meanwhile ends us. */
static int sup_answer(int c, int s, const char *id, uint8_t *type, uint8_t *buf, uint32_t *len)
{
	struct pollfd p[2] = {{.fd = s, .events = POLLIN}, {.fd = c, .events = POLLIN}};
	while (c >= 0 && !(p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
		if (poll(p, 2, -1) < 0 && errno != EINTR) break;
		if (p[1].revents) client_gone(); /* callers send nothing more: this is EOF */
	}
	if (read_frame(s, type, buf, len) == 0) return 0;
	if (c >= 0) send_err(c, ENOENT, "process '%s' was removed (or its supervisor died) during the call", id);
	return -1;
}

/* One request, one answer, passed through as is. */
static void relay_simple(int c, const char *id, uint8_t type, const uint8_t *req, uint32_t n)
{
	uint8_t at;
	uint32_t alen;
	int s = sup_open(c, id, type, req, n);
	if (s < 0) return;
	if (sup_answer(c, s, id, &at, data_buf, &alen) == 0) send_frame(c, at, data_buf, alen);
	close(s);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* Ids (numbers) of the supervisors in the run directory, sorted; `done` picks
 * the finished ones (their .done markers). Caller frees. */
static size_t list_ids(uint64_t **out, int done)
{
	size_t n = 0, cap = 0;
	uint64_t *ids = NULL;
	DIR *d = *run_dir ? opendir(run_dir) : NULL;
	struct dirent *de;
	while (d && (de = readdir(d))) {
		char *end;
		if (de->d_name[0] != 'p' || de->d_name[1] < '1' || de->d_name[1] > '9') continue;
		uint64_t v = strtoull(de->d_name + 1, &end, 10);
		if (strcmp(end, done ? ".done" : "")) continue;
		if (n == cap) {
			uint64_t *ni = realloc(ids, (cap = cap ? cap * 2 : 64) * sizeof *ids);
			if (!ni) break;
			ids = ni;
		}
		ids[n++] = v;
	}
	if (d) closedir(d);
	if (n) qsort(ids, n, sizeof *ids, cmp_u64);
	*out = ids;
	return n;
}

static void op_proc_list(int c)
{
	uint64_t *ids;
	size_t n = list_ids(&ids, 0);
	for (size_t i = 0; i < n; i++) {
		char id[24];
		uint8_t at;
		uint32_t alen;
		snprintf(id, sizeof id, "p%llu", (unsigned long long)ids[i]);
		int s = sup_open(-1, id, 'q', NULL, 0);
		if (s < 0) continue; /* removed meanwhile */
		if (sup_answer(-1, s, id, &at, data_buf, &alen) == 0 && at == 'P') send_frame(c, 'P', data_buf, alen);
		close(s);
	}
	free(ids);
	send_frame(c, 'Z', NULL, 0);
}

/* Keeps at most MAX_FINISHED finished processes: the oldest go first. */
static void evict_finished(void)
{
	uint64_t *ids;
	size_t n = list_ids(&ids, 1);
	for (size_t i = 0; n >= MAX_FINISHED && i <= n - MAX_FINISHED; i++) {
		char id[24], p[sizeof run_dir + 32];
		uint8_t at;
		uint32_t alen;
		snprintf(id, sizeof id, "p%llu", (unsigned long long)ids[i]);
		int s = sup_open(-1, id, 'R', NULL, 0);
		if (s >= 0) {
			sup_answer(-1, s, id, &at, data_buf, &alen);
			close(s);
		} else {
			snprintf(p, sizeof p, "%s/%s.done", run_dir, id);
			unlink(p); /* stale marker */
		}
	}
	free(ids);
}

static void op_spawn(int c, const uint8_t *req, uint32_t n)
{
	struct cmd cm = {.max_out = 4u << 20};
	if (parse_cmd(c, req, n, &cm, "spawn") < 0) return;
	/* initial stdin: read whole (bounded) now, written by the supervisor */
	uint8_t *in = NULL, type;
	size_t in_len = 0;
	uint32_t len;
	for (;;) {
		if (read_frame(c, &type, data_buf, &len) < 0) _exit(0);
		if (type == 'Z') break;
		if (in_len + len > MAX_FRAME) {
			send_err(c, EINVAL, "spawn: stdin over %u bytes: write the rest with proc_stdin", MAX_FRAME);
			return;
		}
		uint8_t *ni = realloc(in, in_len + len);
		if (!ni) _exit(1);
		memcpy((in = ni) + in_len, data_buf, len);
		in_len += len;
	}
	if (*run_dir) {
		/* A command may have removed it (a /tmp clean-up): make it again. */
		char again[sizeof run_dir];
		memcpy(again, run_dir, sizeof again);
		if (make_run_dir(again) < 0) {
			send_err(c, EACCES, "spawn: the supervisors' directory %s is unusable (%s); a command"
				 " replaced it with something else", again, strerror(errno));
			return;
		}
	}
	if (!*run_dir || !spawn_ctr) {
		send_err(c, EROFS, "spawn: the agent found no writable directory for process supervisors");
		return;
	}
	evict_finished();
	char id[24];
	snprintf(id, sizeof id, "p%llu", (unsigned long long)__atomic_add_fetch(spawn_ctr, 1, __ATOMIC_SEQ_CST));
	int rep[2];
	if (pipe2(rep, O_CLOEXEC) < 0) {
		send_err(c, errno, "spawn: pipe: %s", strerror(errno));
		return;
	}
	pid_t sp = fork();
	if (sp < 0) {
		send_err(c, errno, "spawn: fork: %s (process limit reached?)", strerror(errno));
		return;
	}
	if (sp == 0) {
		close(c);
		close(rep[0]);
		start_supervisor(&cm, id, in, in_len, rep[1]);
		_exit(0);
	}
	close(rep[1]);
	uint8_t msg[8 + 512];
	size_t got = 0;
	ssize_t r;
	while (got < sizeof msg && ((r = read(rep[0], msg + got, sizeof msg - got)) > 0 || (r < 0 && errno == EINTR)))
		if (r > 0) got += (size_t)r;
	close(rep[0]);
	int e = got >= 8 ? (int)get32(msg) : EIO;
	if (e) {
		waitpid(sp, NULL, 0);
		if (got > 8) send_err(c, e, "%.*s", (int)(got - 8), (const char *)msg + 8);
		else send_err(c, e, "spawn: the supervisor died while starting");
		return;
	}
	relay_simple(c, id, 'q', NULL, 0);
}

/* Client data frames into the process's stdin pipe, which its supervisor hands us. */
static void op_proc_stdin(int c, const char *id)
{
	char cbuf[CMSG_SPACE(sizeof(int))];
	uint8_t hdr[5], type;
	uint32_t len;
	int fd = -1, s = sup_open(c, id, 'i', NULL, 0);
	if (s < 0) return;
	struct pollfd pw[2] = {{.fd = s, .events = POLLIN}, {.fd = c, .events = POLLIN}};
	while (!(pw[0].revents & (POLLIN | POLLHUP | POLLERR))) {
		if (poll(pw, 2, -1) < 0 && errno != EINTR) break;
		if (pw[1].revents & (POLLHUP | POLLERR)) client_gone();
		pw[1].events = pw[1].revents ? 0 : POLLIN; /* data frames are waiting: fine */
	}
	struct iovec iov = {.iov_base = hdr, .iov_len = 5};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			    .msg_controllen = sizeof cbuf};
	ssize_t k = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
	struct cmsghdr *cm = k > 0 ? CMSG_FIRSTHDR(&mh) : NULL;
	if (cm && cm->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(cm), sizeof fd);
	if (k == 5 && hdr[4] == 'E') {
		uint32_t n = get32(hdr);
		if (n <= MAX_FRAME && read_full(s, data_buf, n) == 0) send_frame(c, 'E', data_buf, n);
		close(s);
		return;
	}
	close(s);
	if (k != 5 || hdr[4] != 'K' || fd < 0) {
		send_err(c, ENOENT, "process '%s' was removed (or its supervisor died) during the call", id);
		return;
	}
	int e = 0;
	fcntl(fd, F_SETFL, O_NONBLOCK);
	for (;;) {
		if (read_frame(c, &type, data_buf, &len) < 0) _exit(0);
		if (type == 'Z') break;
		for (uint32_t done = 0; !e && done < len;) {
			ssize_t w = write(fd, data_buf + done, len - done);
			if (w > 0) {
				done += (uint32_t)w;
			} else if (w < 0 && errno == EAGAIN) {
				/* the process is not reading: wait, but not past the idle bound */
				struct pollfd p[2] = {{.fd = fd, .events = POLLOUT}, {.fd = c, .events = 0}};
				if (poll(p, 2, IDLE_TIMEOUT_S * 1000) == 0) e = ETIMEDOUT;
				if (p[1].revents & (POLLHUP | POLLERR)) client_gone();
			} else if (w < 0 && errno != EINTR) {
				e = errno;
			}
		}
	}
	close(fd);
	if (e == EPIPE) send_err(c, EPIPE, "process %s closed its stdin (or ended)", id);
	else if (e) send_err(c, e, "stdin of process %s: %s", id, strerror(e));
	else send_frame(c, 'K', NULL, 0);
}

/* Output from an offset: 'O' frames, then 'Z'. With `follow`, new output is
 * streamed until the process ends (and its output up to then is sent) or the
 * timeout passes. */
static void op_proc_output(int c, const char *id, int stream, uint64_t offset, int follow, int has_t,
			   uint64_t tmo)
{
	uint64_t deadline = has_t ? now_ns() + tmo * 1000000u : 0, target = 0;
	for (int first = 1;; first = 0) {
		uint8_t q[64], at;
		uint32_t alen;
		size_t qn = put_u64_field(q, 'S', (uint64_t)stream);
		qn += put_u64_field(q + qn, 'F', offset);
		int s = sup_open(c, id, 'o', q, qn);
		if (s < 0) return;
		int bad = sup_answer(c, s, id, &at, data_buf, &alen) < 0;
		close(s);
		if (bad) return;
		if (at != 'O' || alen < 33) {
			send_frame(c, at, data_buf, alen);
			return;
		}
		uint64_t next = ((uint64_t)get32(data_buf + 8) << 32) | get32(data_buf + 12);
		uint64_t total = ((uint64_t)get32(data_buf + 24) << 32) | get32(data_buf + 28);
		uint8_t flags = data_buf[32];
		if (first) target = total;
		if (alen > 33 || first) send_frame(c, 'O', data_buf, alen);
		offset = next;
		uint64_t now = now_ns();
		if (deadline && now >= deadline) break;
		if (alen > 33 && (follow || offset < target)) continue;
		if (!follow || (flags & 3)) break;
		/* nothing new: park at the supervisor until there is */
		qn += put_u64_field(q + qn, 't', deadline ? (deadline - now) / 1000000u + 1 : 0);
		s = sup_open(c, id, 'n', q, deadline ? qn : qn - 13);
		if (s < 0) return;
		bad = sup_answer(c, s, id, &at, data_buf, &alen) < 0;
		close(s);
		if (bad) return;
	}
	send_frame(c, 'Z', NULL, 0);
}

static void op_proc(int c, uint8_t type, const uint8_t *req, uint32_t n)
{
	struct field f;
	uint32_t off = 0;
	char *id = NULL;
	uint64_t stream = 1, offset = 0, follow = 0, tmo = 0;
	int r, has_t = 0;
	while ((r = next_field(req, n, &off, &f)) > 0) {
		if (f.tag == 'i' && !(id = field_str(&f))) r = -1;
		if (r < 0) break;
		if (f.tag == 'S') stream = field_u64(&f);
		if (f.tag == 'F') offset = field_u64(&f);
		if (f.tag == 'f') follow = field_u64(&f);
		if (f.tag == 't') tmo = field_u64(&f), has_t = 1;
	}
	if (r < 0 || !id || !valid_id(id)) {
		send_err(c, ENOENT, "no process '%s' in this sandbox (ids look like p1, p2, ...)", id ? id : "");
		return;
	}
	switch (type) {
	case 'i': op_proc_stdin(c, id); break;
	case 'o':
		if (stream != 1 && stream != 2) {
			send_err(c, EINVAL, "proc_output: stream must be 1 (stdout) or 2 (stderr)");
			break;
		}
		op_proc_output(c, id, (int)stream, offset, follow != 0, has_t, tmo);
		break;
	default: relay_simple(c, id, type, req, n);
	}
}

static void handle(int c)
{
	struct timeval tv = {IDLE_TIMEOUT_S, 0};
	uint8_t type;
	uint32_t len;
	/* a client that stops reading or writing must not pin a handler forever */
	setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
	if (read_frame(c, &type, req_buf, &len) < 0) return;
	if (type == 'p') {
		op_ping(c);
		return;
	}
	if (type == 'x') {
		op_exec(c, req_buf, len);
		return;
	}
	if (type == 'S') {
		op_spawn(c, req_buf, len);
		return;
	}
	if (type == 'L') {
		op_proc_list(c);
		return;
	}
	if (strchr("WkiIoR", type) && type) {
		op_proc(c, type, req_buf, len);
		return;
	}
	struct field f;
	uint32_t off = 0;
	char *path = NULL;
	uint64_t flag = 0, mode = type == 'w' ? 0644 : 0755;
	int r;
	while ((r = next_field(req_buf, len, &off, &f)) > 0) {
		if (f.tag == 'P' && !(path = field_str(&f))) r = -1;
		if (r < 0) break;
		if (f.tag == 'R') flag = field_u64(&f);
		if (f.tag == 'M') mode = field_u64(&f);
	}
	if (r < 0 || !path || !*path) {
		send_err(c, EINVAL, "malformed request: the path is missing, empty or holds a NUL byte");
		return;
	}
	switch (type) {
	case 'r': op_read(c, path); break;
	case 'w': op_write(c, path, (mode_t)mode); break;
	case 'l': op_list(c, path); break;
	case 's': stat_reply(c, "stat", path); break;
	case 'u': op_remove(c, path, flag != 0); break;
	case 'm': op_mkdir(c, path, flag != 0, (mode_t)mode); break;
	default: send_err(c, EINVAL, "unknown request type 0x%02x (agent version %s)", type, VERSION);
	}
}

/* ------------------------------------------------------------------ guest mode: the mux */

/* Frames on the port: u8 type | u32 channel | u32 length | payload, big-endian
 * (protocol.py has the whole protocol). */
#define MUX_HDR 9
#define MUX_PAYLOAD (64u << 10)        /* largest payload */
#define MUX_WINDOW (256u << 10)        /* unacknowledged bytes per channel and direction */
#define MUX_CHANS 256                  /* channels at once; more are refused with C */
#define MUX_RESERVE (12u << 10)        /* output room kept for A/F/C/H/Q frames */
#define MUX_PAD (MUX_HDR + MUX_PAYLOAD) /* zero bytes: end any half-sent frame */
#define MUX_VERSION 1
#define RNDADDENTROPY 0x40085203 /* _IOW('R', 3, int[2]); no kernel headers with musl */
#define RNDRESEEDCRNG 0x5207     /* _IO('R', 7) */

/* The S frame (its payload a fixed magic): found byte by byte when out of sync. */
static const uint8_t mux_sync[MUX_HDR + 16] = {'S', 0, 0, 0, 0, 0, 0, 0, 16, 's', 'a', 'n', 'd', 'f',
					       'l', 'e', 'e', 't', '-', 'm', 'u', 'x', '-', 'v', '1'};

struct mux_chan {
	uint32_t id;
	int fd;           /* our end of the channel's socketpair; -1 once closed */
	int peer;         /* PID 1's end until it is passed, else -1 */
	uint8_t *ring;    /* host data the local end did not take yet (MUX_WINDOW bytes) */
	uint32_t rhead, rlen;
	uint32_t to_ack;  /* delivered to the local end, not acknowledged yet */
	uint32_t unacked; /* sent to the host, not acknowledged yet */
	uint8_t host_fin, shut, local_eof, hup;
};

static struct mux_chan chans[MUX_CHANS];
static int nchans;
static uint8_t mux_in[2 * (MUX_HDR + MUX_PAYLOAD)];
static uint32_t in_len;
static uint8_t mux_out[3 * (MUX_HDR + MUX_PAYLOAD)];
static uint32_t out_off, out_len;
static int desync;   /* discarding input up to the next S frame */
static int pad_owed; /* zeros to send: make the host start a new session */

static void mux_log(const char *fmt, ...)
{
	char msg[256];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (n >= (int)sizeof msg) n = sizeof msg - 1;
	if (n > 0 && dprintf(2, "sandfleet-agent mux: %.*s\n", n, msg) < 0) return;
}

static uint32_t out_free(void) { return (uint32_t)sizeof mux_out - (out_len - out_off); }

/* Room for n more bytes at the end of the output (pending bytes move to the front). */
static uint8_t *out_tail(uint32_t n)
{
	if (sizeof mux_out - out_len < n && out_off) {
		memmove(mux_out, mux_out + out_off, out_len - out_off);
		out_len -= out_off;
		out_off = 0;
	}
	return sizeof mux_out - out_len >= n ? mux_out + out_len : NULL;
}

static void put_hdr(uint8_t *p, uint8_t type, uint32_t ch, uint32_t n)
{
	p[0] = type;
	put32(p + 1, ch);
	put32(p + 5, n);
}

static void out_frame(uint8_t type, uint32_t ch, const void *payload, uint32_t n)
{
	uint8_t *p = out_tail(MUX_HDR + n);
	if (!p) return; /* cannot happen: input and local reads stop short of MUX_RESERVE */
	put_hdr(p, type, ch, n);
	if (n) memcpy(p + MUX_HDR, payload, n);
	out_len += MUX_HDR + n;
}

/* Writes what the port takes now; -1 when the host side is gone. */
static int mux_flush(void)
{
	while (out_off < out_len) {
		ssize_t w = write(vport_fd, mux_out + out_off, out_len - out_off);
		if (w > 0) {
			out_off += (uint32_t)w;
			continue;
		}
		if (w < 0 && errno == EINTR) continue;
		if (w == 0 || errno == EAGAIN) break;
		return -1;
	}
	if (out_off == out_len) out_off = out_len = 0;
	return 0;
}

static struct mux_chan *mux_find(uint32_t id)
{
	for (int i = 0; i < nchans; i++)
		if (chans[i].fd >= 0 && chans[i].id == id) return &chans[i];
	return NULL;
}

/* Closes a channel's local end at once (its handler sees EOF or EPIPE and ends
 * the call); `tell` the host with C. The slot is reused after mux_compact(). */
static void mux_close(struct mux_chan *c, int tell)
{
	if (tell) out_frame('C', c->id, NULL, 0);
	close(c->fd);
	if (c->peer >= 0) close(c->peer);
	free(c->ring);
	*c = (struct mux_chan){.fd = -1, .peer = -1};
}

static void mux_compact(void)
{
	int j = 0;
	for (int i = 0; i < nchans; i++)
		if (chans[i].fd >= 0) chans[j++] = chans[i];
	nchans = j;
}

/* Every channel goes (no C: the host dropped its side already or asked for this). */
static void mux_drop(void)
{
	for (int i = 0; i < nchans; i++)
		if (chans[i].fd >= 0) mux_close(&chans[i], 0);
	nchans = 0;
}

/* PID 1 serves the other end like an accepted connection. It may lag behind:
 * then the end waits here and goes when the socket is writable again. */
static void mux_pass(struct mux_chan *c)
{
	uint8_t one = 1;
	if (send_fd(chan_sock[1], c->peer, &one, 1, MSG_DONTWAIT) == 1) {
		close(c->peer);
		c->peer = -1;
	} else if (errno != EAGAIN && errno != EINTR) {
		mux_log("cannot pass channel %u to PID 1: %s", c->id, strerror(errno));
		mux_close(c, 1);
	}
}

static void mux_open(uint32_t id)
{
	int sv[2];
	struct mux_chan *c = mux_find(id);
	if (c) { /* the host never reuses an id within a session: refuse both */
		mux_close(c, 1);
		return;
	}
	if (nchans == MUX_CHANS) mux_compact();
	if (nchans == MUX_CHANS || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
		out_frame('C', id, NULL, 0);
		return;
	}
	fcntl(sv[0], F_SETFL, O_NONBLOCK);
	c = &chans[nchans++];
	*c = (struct mux_chan){.id = id, .fd = sv[0], .peer = sv[1]};
	mux_pass(c);
}

/* Host data for the local end: straight into the socket, the rest into the
 * ring (never more than the window the host may have unacknowledged). */
static void mux_deliver(struct mux_chan *c, const uint8_t *p, uint32_t n)
{
	if (c->host_fin || !n) return;
	if (!c->rlen) {
		ssize_t w = send(c->fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (w < 0 && errno != EAGAIN && errno != EINTR) {
			mux_close(c, 1); /* the handler is gone */
			return;
		}
		if (w > 0) p += w, n -= (uint32_t)w, c->to_ack += (uint32_t)w;
		if (!n) return;
	}
	if (n > MUX_WINDOW - c->rlen || (!c->ring && !(c->ring = malloc(MUX_WINDOW)))) {
		mux_log("channel %u: host data over the window (or no memory): channel aborted", c->id);
		mux_close(c, 1);
		return;
	}
	uint32_t at = (c->rhead + c->rlen) % MUX_WINDOW;
	uint32_t first = MUX_WINDOW - at < n ? MUX_WINDOW - at : n;
	memcpy(c->ring + at, p, first);
	memcpy(c->ring, p + first, n - first);
	c->rlen += n;
}

static void mux_drain_ring(struct mux_chan *c)
{
	while (c->rlen) {
		uint32_t k = MUX_WINDOW - c->rhead < c->rlen ? MUX_WINDOW - c->rhead : c->rlen;
		ssize_t w = send(c->fd, c->ring + c->rhead, k, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (w < 0 && (errno == EAGAIN || errno == EINTR)) return;
		if (w <= 0) {
			mux_close(c, 1);
			return;
		}
		c->rhead = (c->rhead + (uint32_t)w) % MUX_WINDOW;
		c->rlen -= (uint32_t)w;
		c->to_ack += (uint32_t)w;
	}
	free(c->ring); /* an idle channel holds no buffer */
	c->ring = NULL;
	c->rhead = 0;
}

/* Local data goes out only within the host's credit and the output's room:
 * a slow reader on the host stalls its own channel and nothing else. */
static int mux_can_read(const struct mux_chan *c)
{
	return c->fd >= 0 && !c->local_eof && c->unacked < MUX_WINDOW &&
	       out_free() >= MUX_HDR + MUX_PAYLOAD + MUX_RESERVE;
}

static void mux_read_local(struct mux_chan *c)
{
	uint32_t n = MUX_WINDOW - c->unacked < MUX_PAYLOAD ? MUX_WINDOW - c->unacked : MUX_PAYLOAD;
	uint8_t *p = out_tail(MUX_HDR + n);
	ssize_t r = p ? read(c->fd, p + MUX_HDR, n) : -1;
	if (r > 0) {
		put_hdr(p, 'D', c->id, (uint32_t)r);
		out_len += MUX_HDR + (uint32_t)r;
		c->unacked += (uint32_t)r;
	} else if (r == 0) {
		c->local_eof = 1;
		out_frame('F', c->id, NULL, 0);
	} else if (p && errno != EAGAIN && errno != EINTR) {
		mux_close(c, 1);
	}
}

/* Without the capabilities (a test run as a user, a restarted mux) these are
 * skipped: said once per mux, not on every hello. */
static void mux_warn(int bit, const char *what)
{
	static int said;
	if (said & bit) return;
	said |= bit;
	mux_log("%s: %s", what, strerror(errno));
}

/* H: u64 realtime ns | u16 hostname length | hostname | 32 bytes entropy. A
 * restored VM's clock is stale and its random state a copy of the template's. */
static void mux_hello(const uint8_t *p, uint32_t n)
{
	uint32_t hl = n >= 10 ? (uint32_t)p[8] << 8 | p[9] : 0;
	if (n < 10 || n != 10 + hl + 32 || hl > 64) {
		mux_log("malformed hello (%u bytes): clock, hostname and entropy left as they are", n);
		return;
	}
	uint64_t ns = (uint64_t)get32(p) << 32 | get32(p + 4);
	struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
	if (ns && clock_settime(CLOCK_REALTIME, &ts) < 0) mux_warn(1, "clock not set");
	if (hl && sethostname((const char *)p + 10, hl) < 0) mux_warn(2, "hostname not set");
	struct {
		int bits, size;
		uint8_t buf[32];
	} ent = {256, 32, {0}};
	memcpy(ent.buf, p + 10 + hl, 32);
	int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
	if (fd < 0 || ioctl(fd, RNDADDENTROPY, &ent) < 0 || ioctl(fd, RNDRESEEDCRNG) < 0)
		mux_warn(4, "entropy not added");
	if (fd >= 0) close(fd);
}

static void mux_frame(uint8_t type, uint32_t ch, const uint8_t *p, uint32_t n)
{
	uint8_t v[4];
	struct mux_chan *c;
	switch (type) {
	case 'S': mux_drop(); break;
	case 'H':
		mux_drop();
		mux_hello(p, n);
		put32(v, MUX_VERSION);
		out_frame('H', 0, v, 4);
		break;
	case 'Q':
		mux_drop();
		sync(); /* the host saves the disk next */
		out_frame('Q', 0, NULL, 0);
		break;
	case 'O': mux_open(ch); break;
	default:
		/* frames of a channel closed meanwhile were in flight: ignored */
		if (!(c = mux_find(ch))) break;
		if (type == 'D') mux_deliver(c, p, n);
		else if (type == 'F') c->host_fin = 1;
		else if (type == 'C') mux_close(c, 0);
		else if (type == 'A' && n == 4) c->unacked -= get32(p) < c->unacked ? get32(p) : c->unacked;
	}
}

/* Parses whole frames off the input. Out of sync (started, or garbage) it
 * skips to the next S frame; the host sends zeros, S and H to start a session. */
static void mux_input(void)
{
	uint32_t off = 0;
	while (out_free() >= MUX_RESERVE + 64) {
		uint8_t *f = mux_in + off;
		uint32_t have = in_len - off;
		if (desync) {
			uint8_t *s = memmem(f, have, mux_sync, sizeof mux_sync);
			if (!s) {
				off = in_len - (have < sizeof mux_sync ? have : sizeof mux_sync - 1);
				break;
			}
			off = (uint32_t)(s - mux_in);
			desync = 0;
			continue;
		}
		if (have < MUX_HDR) break;
		uint32_t n = get32(f + 5);
		if (n > MUX_PAYLOAD || !f[0] || !strchr("SHQODFCA", f[0]) ||
		    (f[0] == 'S' && (n != 16 || (have >= sizeof mux_sync && memcmp(f, mux_sync, sizeof mux_sync))))) {
			/* Zeros are a host starting a session. Anything else is garbage
			 * the host does not know about: answer with zeros, which the host
			 * reads as an invalid frame, so it starts a new session. */
			if (f[0]) {
				mux_log("invalid frame 0x%02x (%u bytes): channels dropped, resynchronising", f[0], n);
				pad_owed = 1;
			}
			mux_drop();
			desync = 1;
			continue;
		}
		if (have < MUX_HDR + n) break;
		off += MUX_HDR + n;
		mux_frame(f[0], get32(f + 1), f + MUX_HDR, n);
	}
	memmove(mux_in, mux_in + off, in_len - off);
	in_len -= off;
}

/* Acknowledgements, half-closes, finished channels. */
static void mux_finish(void)
{
	uint8_t *z;
	if (pad_owed && out_free() >= MUX_PAD + MUX_RESERVE && (z = out_tail(MUX_PAD))) {
		memset(z, 0, MUX_PAD);
		out_len += MUX_PAD;
		pad_owed = 0;
	}
	for (int i = 0; i < nchans; i++) {
		struct mux_chan *c = &chans[i];
		if (c->fd < 0) continue;
		if (c->to_ack) {
			uint8_t a[4];
			put32(a, c->to_ack);
			out_frame('A', c->id, a, 4);
			c->to_ack = 0;
		}
		if (c->host_fin && !c->rlen && !c->shut) {
			shutdown(c->fd, SHUT_WR);
			c->shut = 1;
		}
		if (c->local_eof && c->shut) mux_close(c, 0); /* both sides sent F */
		else if (c->peer >= 0) mux_pass(c);
	}
}

/* The host side is gone (POLLHUP, EOF): whatever is in flight belongs to a
 * session that ended. A virtio port reports POLLHUP until the host is back;
 * check every 50 ms. */
static void mux_disconnected(void)
{
	mux_drop();
	in_len = 0;
	out_off = out_len = 0;
	desync = 1;
	pad_owed = 0; /* a new host starts a new session anyway */
	for (;;) {
		struct timespec ts = {0, 50 * 1000000};
		struct pollfd p = {.fd = vport_fd, .events = POLLIN};
		nanosleep(&ts, NULL);
		int r = poll(&p, 1, 0);
		if ((r < 0 && errno != EINTR) || (p.revents & POLLNVAL)) _exit(1);
		if (r >= 0 && !(p.revents & (POLLHUP | POLLERR))) return;
	}
}

static void mux_loop(void)
{
	static struct pollfd p[2 + MUX_CHANS];
	/* Zeros end any frame a mux before us left half-written: the host then
	 * reads an invalid frame and starts a new session. */
	memset(mux_out, 0, MUX_PAD);
	out_len = MUX_PAD;
	desync = 1;
	for (;;) {
		int pending = 0;
		mux_compact();
		p[0] = (struct pollfd){.fd = vport_fd, .events = out_len > out_off ? POLLOUT : 0};
		if (in_len < sizeof mux_in && out_free() >= MUX_RESERVE + 64) p[0].events |= POLLIN;
		for (int i = 0; i < nchans; i++) {
			struct mux_chan *c = &chans[i];
			short ev = (short)((mux_can_read(c) ? POLLIN : 0) | (c->rlen ? POLLOUT : 0));
			pending |= c->peer >= 0;
			/* a peer that hung up is polled only when there is something to do,
			 * or POLLHUP would wake us in a loop */
			p[2 + i] = (struct pollfd){.fd = ev || !c->hup ? c->fd : -1, .events = ev};
		}
		p[1] = (struct pollfd){.fd = pending ? chan_sock[1] : -1, .events = POLLOUT};
		if (poll(p, 2 + (nfds_t)nchans, -1) < 0) continue;
		if (p[0].revents & POLLNVAL) _exit(1);
		if (p[0].revents & (POLLHUP | POLLERR)) {
			mux_disconnected();
			continue;
		}
		if ((p[0].revents & POLLOUT) && mux_flush() < 0) {
			mux_disconnected();
			continue;
		}
		for (int i = 0; i < nchans; i++) {
			struct mux_chan *c = &chans[i];
			short r = p[2 + i].revents;
			if (c->fd < 0 || !r) continue;
			if (r & (POLLHUP | POLLERR)) c->hup = 1;
			if (c->rlen && (r & (POLLOUT | POLLHUP | POLLERR))) mux_drain_ring(c);
			if ((r & (POLLIN | POLLHUP | POLLERR)) && mux_can_read(c)) mux_read_local(c);
		}
		if (p[0].revents & POLLIN) {
			ssize_t r = read(vport_fd, mux_in + in_len, sizeof mux_in - in_len);
			if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
				mux_disconnected();
				continue;
			}
			if (r > 0) in_len += (uint32_t)r;
		}
		mux_input();
		mux_finish();
		if (mux_flush() < 0) mux_disconnected();
	}
}

/* The mux process: forked by PID 1, before it drops capabilities (the hello
 * sets the clock and hostname), under the guard uid like handlers. */
static void mux_child(void)
{
	for (int fd = 3; fd < 1024; fd++)
		if (fd != vport_fd && fd != chan_sock[1]) close(fd);
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() != main_pid) _exit(0);
	prctl(PR_SET_NAME, "sfmux");
	signal(SIGTERM, SIG_DFL);
	signal(SIGINT, SIG_DFL);
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	/* the sandbox's memory limit must never pick the one way in */
	int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
	if (fd >= 0 && write(fd, "-1000", 5) < 0) mux_log("oom_score_adj: %s", strerror(errno));
	if (fd >= 0) close(fd);
	fcntl(vport_fd, F_SETFL, fcntl(vport_fd, F_GETFL) | O_NONBLOCK);
	fcntl(chan_sock[1], F_SETFL, O_NONBLOCK);
	mux_loop();
}

static uint64_t mux_next; /* monotonic ns: no mux starts before (one a second at most) */

static void start_mux(void)
{
	mux_next = now_ns() + 1000000000u;
	pid_t pid = fork();
	if (pid == 0) {
		mux_child();
		_exit(1);
	}
	if (pid > 0) mux_pid = pid;
}

/* Guest mode: PID 1, and so every handler and command, keeps only the
 * container's AGENT_CAPS (bundle.py): AUDIT_WRITE, KILL, NET_BIND_SERVICE,
 * SETGID, SETUID. Dropping needs no privilege, so without capabilities (tests
 * as a user) this changes nothing. */
static void drop_to_agent_caps(void)
{
	const uint64_t keep = 1ull << 29 | 1ull << 5 | 1ull << 10 | 1ull << 6 | 1ull << 7;
	struct {
		uint32_t version;
		int pid;
	} hdr = {0x20080522 /* _LINUX_CAPABILITY_VERSION_3 */, 0};
	struct {
		uint32_t effective, permitted, inheritable;
	} data[2];
	prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
	if (syscall(SYS_capget, &hdr, data) < 0) return;
	/* the bounding set first: that needs CAP_SETPCAP, which goes next */
	for (int cap = 0; cap < 64 && prctl(PR_CAPBSET_READ, cap, 0, 0, 0) >= 0; cap++)
		if (!(keep >> cap & 1)) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
	prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
	for (int i = 0; i < 2; i++) {
		uint32_t m = (uint32_t)(keep >> (32 * i));
		data[i].effective &= m;
		data[i].permitted &= m;
		data[i].inheritable &= m;
	}
	if (syscall(SYS_capset, &hdr, data) < 0)
		fprintf(stderr, "sandfleet-agent: dropping capabilities: %s\n", strerror(errno));
}

/* ------------------------------------------------------------------ PID 1 */

/* Everything below us goes: handlers, supervisors and all they started. */
static void kill_all(void)
{
	if (getpid() == 1) kill(-1, SIGKILL);
	kill_tree();
}

static int rm_entry(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	if (ftw->level == 0) return 0;
	return flag == FTW_DP ? rmdir(p) : unlink(p);
}

/* The supervisors' directory: ours alone (0700, our uid, not a symlink).
 * Only mkdir/lstat here: PID 1 must not grow a heap. */
static int make_run_dir(const char *path)
{
	struct stat st;
	if (strlen(path) + 24 > sizeof run_dir) return -1; /* sockets must fit sun_path */
	if (mkdir(path, 0700) < 0 && errno != EEXIST) return -1;
	if (lstat(path, &st) < 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() || chmod(path, 0700) < 0)
		return -1;
	strcpy(run_dir, path);
	return 0;
}

static int listen_on(const char *path)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof a.sun_path) {
		fprintf(stderr, "sandfleet-agent: socket path too long (max %zu bytes): %s\n",
			sizeof a.sun_path - 1, path);
		exit(2);
	}
	strcpy(a.sun_path, path);
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	unlink(path); /* a stale socket from an earlier run */
	/* umask keeps the socket private from the moment it exists */
	mode_t old = umask(0177);
	int r = s < 0 ? -1 : bind(s, (struct sockaddr *)&a, sizeof a);
	umask(old);
	if (r < 0 || chmod(path, 0600) < 0 || listen(s, 512) < 0) {
		fprintf(stderr, "sandfleet-agent: cannot listen on %s: %s\n", path, strerror(errno));
		exit(2);
	}
	return s;
}

/* ------------------------------------------------------------------ PID 1: early OOM killer */

/* With --oom-events, PID 1 watches the memory pressure (PSI) of the cgroup
 * that file belongs to. Past its memory limit a process can thrash for a
 * minute under TCG before the kernel's OOM killer acts: limit reclaim keeps
 * evicting the executables' page cache and they keep faulting it back in. As
 * userspace OOM killers do (systemd-oomd: PSI, 60% by default; earlyoom: the
 * largest process), we act first: when all of the cgroup's tasks were stalled
 * on memory ("full") for PSI_FULL_PCT% of PSI_WINDOW_MS, the process with the
 * largest resident set gets SIGKILL. Never PID 1 or the agent (real uid
 * GUARD_UID: handlers, supervisors, the mux). One small read per tick (and
 * memory.events while the cgroup stalls); /proc is read only to pick whom to
 * kill. */
#define PSI_TICK_MS 250
#define PSI_WINDOW_MS 2000
#define PSI_FULL_PCT 60
#define PSI_SAMPLES 16 /* a window's ticks and one more, with room for late ticks */
#define NS_PER_MS 1000000ull

static char psi_path[128], procs_path[128];
static struct {
	uint64_t t, full; /* monotonic ns; "full" stall total, us */
} psi_s[PSI_SAMPLES];  /* oldest first */
static int psi_n;
static uint64_t psi_next;       /* monotonic ns: the next sample is due */
static long long psi_kernel_ooms; /* the kernel's OOM kills, as last read */

/* A small file's contents, NUL-terminated; bytes read or -1. */
static ssize_t read_small(const char *path, char *buf, size_t cap)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) return -1;
	ssize_t n = read(fd, buf, cap - 1);
	close(fd);
	if (n < 0) return -1;
	buf[n] = 0;
	return n;
}

/* The "full ... total=N" of memory.pressure (us stalled), or -1. */
static long long psi_full(void)
{
	char buf[256];
	if (read_small(psi_path, buf, sizeof buf) <= 0) return -1;
	char *l = strstr(buf, "full "), *t = l ? strstr(l, "total=") : NULL;
	return t ? strtoll(t + 6, NULL, 10) : -1;
}

/* Watches if `--oom-events PATH`'s directory has a readable memory.pressure. */
static void psi_init(void)
{
	const char *slash = strrchr(oom_events, '/');
	int dir = slash ? (int)(slash - oom_events) : 1;
	const char *d = slash ? oom_events : ".";
	if (snprintf(psi_path, sizeof psi_path, "%.*s/memory.pressure", dir, d) >= (int)sizeof psi_path ||
	    snprintf(procs_path, sizeof procs_path, "%.*s/cgroup.procs", dir, d) >= (int)sizeof procs_path)
		return;
	psi_on = psi_full() >= 0;
	psi_kernel_ooms = kernel_oom_kills();
}

/* Resident bytes of `pid` if it may be killed and has more than `than`, else 0. */
static uint64_t victim_rss(int pid, uint64_t than)
{
	char p[48], buf[512];
	if (pid <= 1 || pid == main_pid) return 0;
	snprintf(p, sizeof p, "/proc/%d/statm", pid);
	char *sp = read_small(p, buf, sizeof buf) > 0 ? strchr(buf, ' ') : NULL;
	uint64_t rss = sp ? strtoull(sp + 1, NULL, 10) * (uint64_t)sysconf(_SC_PAGESIZE) : 0;
	if (rss <= than) return 0;
	snprintf(p, sizeof p, "/proc/%d/status", pid);
	char *uid = read_small(p, buf, sizeof buf) > 0 ? strstr(buf, "\nUid:") : NULL;
	if (!uid || strtoll(uid + 5, NULL, 10) == GUARD_UID) return 0;
	return rss;
}

/* SIGKILLs the cgroup's process with the largest resident set (see above). */
static void psi_kill(unsigned pct)
{
	char buf[512];
	int fd = open(procs_path, O_RDONLY | O_CLOEXEC), pid = 0, best = 0;
	if (fd < 0) return;
	uint64_t best_rss = 0;
	ssize_t n;
	while ((n = read(fd, buf, sizeof buf)) > 0)
		for (ssize_t i = 0; i < n; i++) {
			if (buf[i] >= '0' && buf[i] <= '9') {
				pid = pid * 10 + (buf[i] - '0');
				continue;
			}
			uint64_t rss = victim_rss(pid, best_rss);
			if (rss) best = pid, best_rss = rss;
			pid = 0;
		}
	close(fd);
	if (!best) return;
	char comm[64] = "?", p[48];
	snprintf(p, sizeof p, "/proc/%d/comm", best);
	if (read_small(p, buf, sizeof buf) > 0) snprintf(comm, sizeof comm, "%.*s", (int)strcspn(buf, "\n"), buf);
	/* counted first: the handler of the command must see it once the kill lands */
	if (psi_kills) __atomic_add_fetch(psi_kills, 1, __ATOMIC_SEQ_CST);
	if (kill(best, SIGKILL) < 0) {
		if (psi_kills) __atomic_sub_fetch(psi_kills, 1, __ATOMIC_SEQ_CST);
		return;
	}
	int k = snprintf(buf, sizeof buf,
			 "sandfleet-agent: memory thrashing (%u%% full stall over %d s): "
			 "killed pid %d (%s, %llu MiB resident)\n",
			 pct, PSI_WINDOW_MS / 1000, best, comm, (unsigned long long)(best_rss >> 20));
	ssize_t w = k > 0 ? write(2, buf, (size_t)k < sizeof buf ? (size_t)k : sizeof buf - 1) : 0;
	(void)w; /* nobody to tell if the console is gone */
}

/* Takes a PSI sample when one is due and kills when the window shows thrashing.
 * Returns the ns until the next sample: serve()'s longest sleep. */
static uint64_t psi_tick(void)
{
	uint64_t now = now_ns();
	if (now < psi_next && psi_next - now <= PSI_TICK_MS * NS_PER_MS) return psi_next - now;
	psi_next = now + PSI_TICK_MS * NS_PER_MS;
	long long full = psi_full();
	if (full < 0) return PSI_TICK_MS * NS_PER_MS;
	if (psi_n && (now < psi_s[psi_n - 1].t || (uint64_t)full < psi_s[psi_n - 1].full))
		psi_n = 0; /* a clock or counter that went back (a restored snapshot?): start over */
	/* While it stalls, the kernel's OOM kills too: the stall that led to one is
	 * no reason to kill another process (its victim has no RSS left by now),
	 * so a new window starts. Idle, this costs nothing. */
	if (!psi_n || (uint64_t)full != psi_s[psi_n - 1].full) {
		long long k = kernel_oom_kills();
		if (k != psi_kernel_ooms) psi_kernel_ooms = k, psi_n = 0;
	}
	if (psi_n == PSI_SAMPLES) memmove(psi_s, psi_s + 1, sizeof psi_s - sizeof *psi_s), psi_n--;
	psi_s[psi_n].t = now;
	psi_s[psi_n++].full = (uint64_t)full;
	/* the window starts at the newest sample at least PSI_WINDOW_MS old */
	int w = -1;
	for (int i = 0; i < psi_n && now - psi_s[i].t >= PSI_WINDOW_MS * NS_PER_MS; i++) w = i;
	if (w < 0) return PSI_TICK_MS * NS_PER_MS;
	memmove(psi_s, psi_s + w, (size_t)(psi_n -= w) * sizeof *psi_s);
	uint64_t span_us = (now - psi_s[0].t) / 1000, stalled = (uint64_t)full - psi_s[0].full;
	if (stalled * 100 >= span_us * PSI_FULL_PCT) {
		psi_kill((unsigned)(stalled * 100 / span_us));
		psi_n = 0; /* the next kill needs a whole new window */
	}
	return PSI_TICK_MS * NS_PER_MS;
}

static void serve(int ls)
{
	static struct pollfd p[2 + MAX_DRAIN];
	static uint8_t sink[4096];
	int nd = 0;
	for (;;) {
		if (got_chld) reap_kids();
		if (got_term) return;
		struct timespec ts, *tp = NULL;
		if (vport_fd >= 0 && !mux_pid) {
			uint64_t now = now_ns();
			if (now >= mux_next) start_mux();
			if (!mux_pid) { /* wait, or a mux that dies at once would spin */
				uint64_t d = mux_next > now ? mux_next - now : 0;
				ts = (struct timespec){(time_t)(d / 1000000000u), (long)(d % 1000000000u)};
				tp = &ts;
			}
		}
		if (psi_on) { /* the early OOM killer: a sample at least every PSI_TICK_MS */
			uint64_t d = psi_tick();
			if (!tp || d < (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec)
				ts = (struct timespec){(time_t)(d / 1000000000u), (long)(d % 1000000000u)}, tp = &ts;
		}
		p[0] = (struct pollfd){.fd = ls, .events = POLLIN};
		p[1] = (struct pollfd){.fd = handoff[0], .events = POLLIN};
		if (ppoll(p, 2 + (nfds_t)nd, tp, &wait_mask) < 0) continue;
		for (int i = 2; i < 2 + nd; i++) {
			if (!p[i].revents) continue;
			ssize_t r = read(p[i].fd, sink, sizeof sink);
			if (r > 0 || (r < 0 && errno == EAGAIN)) continue;
			close(p[i].fd);
			p[i--] = p[1 + nd--];
		}
		if (p[1].revents & POLLIN) {
			int fd = recv_fd(handoff[0]);
			if (fd >= 0 && nd < MAX_DRAIN) p[2 + nd++] = (struct pollfd){.fd = fd, .events = POLLIN};
			else if (fd >= 0) close(fd); /* too many: the job gets SIGPIPE if it writes */
		}
		if (!(p[0].revents & POLLIN)) continue;
		/* a connection: accepted, or in guest mode a channel's end from the mux */
		int c = vport_fd >= 0 ? recv_fd(ls) : accept4(ls, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0) continue;
		pid_t pid = fork();
		if (pid == 0) {
			close(ls);
			close(handoff[0]);
			for (int i = 2; i < 2 + nd; i++) close(p[i].fd);
			if (vport_fd >= 0) close(vport_fd), close(chan_sock[1]);
			signal(SIGTERM, SIG_DFL);
			signal(SIGINT, SIG_DFL);
			handle(c);
			/* Close only after the client did: closing with unread request data
			 * would reset the connection and lose the answer already sent. */
			shutdown(c, SHUT_WR);
			fcntl(c, F_SETFL, 0);
			while (read(c, data_buf, CHUNK) > 0) {
			}
			_exit(0);
		}
		if (pid < 0) {
			/* tiny and non-blocking: PID 1 must never wait on a client */
			uint8_t msg[128] = {0, 0, 0, 0, 'E', 0, 0, 0, (uint8_t)EAGAIN};
			int n = snprintf((char *)msg + 9, sizeof msg - 9, "agent cannot fork: %s", strerror(errno));
			put32(msg, (uint32_t)(4 + n));
			send(c, msg, 9 + (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
			/* Closing with the request unread would reset the connection, and
			 * the client (or the VM's mux) could lose the answer: read what came. */
			static uint8_t unread[4096];
			while (recv(c, unread, sizeof unread, MSG_DONTWAIT) > 0) {
			}
		}
		close(c);
	}
}

static void usage(void)
{
	fprintf(stderr, "usage: sandfleet-agent (--socket PATH | --listen-fd N | --vport-fd N | --vport PATH)\n"
			"                       [--workdir DIR] [--run-dir DIR] [--oom-events PATH]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	const char *workdir = NULL, *rundir_arg = NULL, *vport_path = NULL;
	int ls = -1;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--socket") && i + 1 < argc) sock_path = argv[++i];
		/* a listening socket made by the node (e.g. runc --preserve-fds):
		 * then no socket file needs to be visible inside the sandbox */
		else if (!strcmp(argv[i], "--listen-fd") && i + 1 < argc) ls = atoi(argv[++i]);
		/* guest mode: the virtio-serial port, opened by init or by us */
		else if (!strcmp(argv[i], "--vport-fd") && i + 1 < argc) vport_fd = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--vport") && i + 1 < argc) vport_path = argv[++i];
		else if (!strcmp(argv[i], "--oom-events") && i + 1 < argc) oom_events = argv[++i];
		else if (!strcmp(argv[i], "--workdir") && i + 1 < argc) workdir = argv[++i];
		/* where supervisors of spawned processes listen (default: see below) */
		else if (!strcmp(argv[i], "--run-dir") && i + 1 < argc) rundir_arg = argv[++i];
		else if (!strcmp(argv[i], "--version")) return puts("sandfleet-agent " VERSION) < 0;
		else usage();
	}
	if ((sock_path != NULL) + (ls >= 0) + (vport_fd >= 0) + (vport_path != NULL) != 1) usage();
	if (vport_path && (vport_fd = open(vport_path, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
		fprintf(stderr, "sandfleet-agent: --vport %s: %s\n", vport_path, strerror(errno));
		return 2;
	}
	if (vport_fd >= 0 && fcntl(vport_fd, F_SETFD, FD_CLOEXEC) < 0) {
		fprintf(stderr, "sandfleet-agent: --vport-fd %d: %s\n", vport_fd, strerror(errno));
		return 2;
	}
	/* As PID 1 of a bare box, 0-2 may be closed; keep pipes off those numbers. */
	for (int fd = 0; fd < 3; fd++)
		if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0) break;
	if (workdir && chdir(workdir) < 0) {
		fprintf(stderr, "sandfleet-agent: --workdir %s: %s\n", workdir, strerror(errno));
		return 2;
	}
	main_pid = getpid();
	if (main_pid != 1) prctl(PR_SET_CHILD_SUBREAPER, 1);
	/* The processes serving calls (handlers, supervisors) keep a real and saved
	 * uid that no command has, and commands lose CAP_KILL: then no command, not
	 * even root's `kill -9 -1`, can signal or ptrace them and lose or forge a
	 * call's result. The effective uid stays 0 for file operations. */
	if (geteuid() == 0 && setresuid(GUARD_UID, 0, GUARD_UID) < 0)
		fprintf(stderr, "sandfleet-agent: guard uid: %s\n", strerror(errno));
	/* PID 1 of a sandbox: /run/sandfleet, or /tmp if the rootfs is read-only there.
	 * An ordinary process (tests, several agents on one host): a directory of its own. */
	char own[64];
	snprintf(own, sizeof own, "/tmp/.sandfleet-run.%d", (int)main_pid);
	if (rundir_arg) {
		if (make_run_dir(rundir_arg) < 0) {
			fprintf(stderr, "sandfleet-agent: --run-dir %s: unusable (%s)\n", rundir_arg, strerror(errno));
			return 2;
		}
	} else if (main_pid == 1) {
		if (make_run_dir("/run/sandfleet") < 0) make_run_dir("/tmp/.sandfleet-run");
	} else {
		make_run_dir(own);
	}
	void *shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (shared != MAP_FAILED) spawn_ctr = shared, psi_kills = spawn_ctr + 1;
	if (oom_events) psi_init();

	struct sigaction sa = {.sa_handler = on_signal};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGCHLD, &sa, NULL);
	sigaction(SIGALRM, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	sigset_t block;
	sigemptyset(&block);
	sigaddset(&block, SIGCHLD);
	sigaddset(&block, SIGALRM);
	sigaddset(&block, SIGTERM);
	sigaddset(&block, SIGINT);
	sigprocmask(SIG_BLOCK, &block, &wait_mask);
	sigdelset(&wait_mask, SIGCHLD);
	sigdelset(&wait_mask, SIGALRM);
	sigdelset(&wait_mask, SIGTERM);
	sigdelset(&wait_mask, SIGINT);

	if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, handoff) < 0) return 2;
	fcntl(handoff[0], F_SETFL, O_NONBLOCK);
	if (vport_fd >= 0) {
		/* channels come from the mux; a datagram per fd, never merged */
		if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, chan_sock) < 0) return 2;
		fcntl(chan_sock[0], F_SETFL, O_NONBLOCK);
		ls = chan_sock[0];
		start_mux();
		drop_to_agent_caps();
	} else if (ls >= 0) {
		if (fcntl(ls, F_SETFD, FD_CLOEXEC) < 0 || fcntl(ls, F_SETFL, O_NONBLOCK) < 0) {
			fprintf(stderr, "sandfleet-agent: --listen-fd %d: %s\n", ls, strerror(errno));
			return 2;
		}
	} else {
		ls = listen_on(sock_path);
	}
	serve(ls);
	close(ls);
	if (sock_path) unlink(sock_path);
	kill_all();
	/* supervisors were killed: their sockets and markers stay behind */
	if (*run_dir) {
		nftw(run_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
		if (!rundir_arg) rmdir(run_dir);
	}
	return 0;
}
