/* iscsi_copy: a whole LUN to or from a stream, over iSCSI/TCP or iSER
 * (libiscsi), for a data-verifying write and read (Debian packages no
 * iscsi-dd).
 *
 *   iscsi_copy -i INITIATOR write URL < DATA   writes DATA over the whole LUN
 *   iscsi_copy -i INITIATOR read URL > DATA    reads the whole LUN
 *
 * URL is iscsi://HOST[:PORT]/TARGET/LUN or iser://HOST[:PORT]/TARGET/LUN.
 * DATA must hold exactly the LUN's size; the caller compares checksums of
 * what went in, what the target's backing file holds, and what came out.
 * Prints "iscsi_copy: BYTES bytes in SECONDS s (MB/s)" on stderr; any SCSI
 * or transport error, or a short stream, exits 1. */
#include <errno.h>
#include <iscsi/iscsi.h>
#include <iscsi/scsi-lowlevel.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* One SCSI command moves this much: a multiple of any block size, and
 * within what tgt takes in one iSER command. */
#define CHUNK (256 * 1024)

static int full_io(int fd, unsigned char *buf, size_t len, int writing)
{
	size_t done = 0;
	while (done < len) {
		ssize_t n = writing ? write(fd, buf + done, len - done)
				    : read(fd, buf + done, len - done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		done += (size_t)n;
	}
	return 0;
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	const char *initiator = "iqn.2026-11.org.stag:iscsi-copy";
	int opt;
	while ((opt = getopt(argc, argv, "i:")) != -1) {
		if (opt != 'i') {
			fprintf(stderr, "usage: iscsi_copy [-i INITIATOR] read|write URL\n");
			return 2;
		}
		initiator = optarg;
	}
	if (argc - optind != 2 || (strcmp(argv[optind], "read") && strcmp(argv[optind], "write"))) {
		fprintf(stderr, "usage: iscsi_copy [-i INITIATOR] read|write URL\n");
		return 2;
	}
	int writing = !strcmp(argv[optind], "write");
	const char *url_text = argv[optind + 1];

	struct iscsi_context *iscsi = iscsi_create_context(initiator);
	if (!iscsi) {
		fprintf(stderr, "iscsi_copy: cannot create a context\n");
		return 1;
	}
	struct iscsi_url *url = iscsi_parse_full_url(iscsi, url_text);
	if (!url) {
		fprintf(stderr, "iscsi_copy: bad URL %s: %s\n", url_text, iscsi_get_error(iscsi));
		return 1;
	}
	iscsi_set_targetname(iscsi, url->target);
	iscsi_set_session_type(iscsi, ISCSI_SESSION_NORMAL);
	iscsi_set_header_digest(iscsi, ISCSI_HEADER_DIGEST_NONE_CRC32C);
	if (iscsi_full_connect_sync(iscsi, url->portal, url->lun) != 0) {
		fprintf(stderr, "iscsi_copy: login to %s failed: %s\n", url_text, iscsi_get_error(iscsi));
		return 1;
	}
	int lun = url->lun;

	struct scsi_task *task = iscsi_readcapacity16_sync(iscsi, lun);
	struct scsi_readcapacity16 *cap = NULL;
	if (task && task->status == SCSI_STATUS_GOOD)
		cap = scsi_datain_unmarshall(task);
	if (!cap) {
		fprintf(stderr, "iscsi_copy: READ CAPACITY(16) failed: %s\n", iscsi_get_error(iscsi));
		return 1;
	}
	uint32_t block = cap->block_length;
	uint64_t blocks = cap->returned_lba + 1;
	scsi_free_scsi_task(task);
	uint64_t size = blocks * block;
	if (block == 0 || CHUNK % block) {
		fprintf(stderr, "iscsi_copy: block size %u does not divide %d\n", block, CHUNK);
		return 1;
	}

	unsigned char *buf = malloc(CHUNK);
	if (!buf)
		return 1;
	double start = now();
	for (uint64_t off = 0; off < size; off += CHUNK) {
		uint32_t len = size - off < CHUNK ? (uint32_t)(size - off) : CHUNK;
		uint64_t lba = off / block;
		if (writing) {
			if (full_io(0, buf, len, 0)) {
				fprintf(stderr, "iscsi_copy: input ends before %llu bytes\n",
					(unsigned long long)size);
				return 1;
			}
			task = iscsi_write16_sync(iscsi, lun, lba, buf, len, block, 0, 0, 0, 0, 0);
		} else {
			task = iscsi_read16_sync(iscsi, lun, lba, len, block, 0, 0, 0, 0, 0);
		}
		if (!task || task->status != SCSI_STATUS_GOOD) {
			fprintf(stderr, "iscsi_copy: %s at lba %llu failed: %s\n",
				writing ? "WRITE(16)" : "READ(16)", (unsigned long long)lba,
				iscsi_get_error(iscsi));
			return 1;
		}
		if (!writing) {
			if (task->datain.size != (int)len || full_io(1, task->datain.data, len, 1)) {
				fprintf(stderr, "iscsi_copy: short read or output at lba %llu\n",
					(unsigned long long)lba);
				return 1;
			}
		}
		scsi_free_scsi_task(task);
	}
	if (writing) {
		task = iscsi_synchronizecache16_sync(iscsi, lun, 0, 0, 0, 0);
		if (!task || task->status != SCSI_STATUS_GOOD) {
			fprintf(stderr, "iscsi_copy: SYNCHRONIZE CACHE failed: %s\n",
				iscsi_get_error(iscsi));
			return 1;
		}
		scsi_free_scsi_task(task);
		if (read(0, buf, 1) != 0) {
			fprintf(stderr, "iscsi_copy: input longer than the LUN (%llu bytes)\n",
				(unsigned long long)size);
			return 1;
		}
	}
	double secs = now() - start;
	fprintf(stderr, "iscsi_copy: %llu bytes in %.2f s (%.1f MB/s)\n", (unsigned long long)size,
		secs, size / secs / 1e6);
	free(buf);
	iscsi_logout_sync(iscsi);
	iscsi_destroy_url(url);
	iscsi_destroy_context(iscsi);
	return 0;
}
