"""Records, ArrayRecord shards, curation and the grain loader (DESIGN "Records", SPEC §7).

    Record / RecordError / validate_record        data.records
    ShardWriter / write_records / RecordSource    data.shards   (manifest.json + shards)
    BatchLoader / LoaderOptions / make_loader     data.loader   (-> data.batch.Batch)
    loader_from_config                            data.loader   (what the trainer calls)
    select / curate_directory / transform_rewards data.curation
"""
